#!/usr/bin/env bash
# One sitting of training on a lent GPU machine (issues #45, #57), as one prepared command:
#   bash training/gpu_sitting.sh MINUTES          # v3's stage 2 (runs/tiny-arena-vl-v3)
#   bash training/gpu_sitting.sh MINUTES v31      # v3.1, from the bundle (runs/tiny-arena-vl-v3.1)
# It runs from the repository root there, with the wheels in .whl/ (transformers at the version this
# project needs; the machine's torch is used as it is) and $OUT for what comes back. A run carried in
# runs/ (the run's folder, given in `carry`) is resumed; the run, its curve and the log come back
# under $OUT. Back here:
#   cp $FILES_AT/run/* runs/tiny-arena-vl-v3/ && python -m training.train_arena_v3 --eyes training/stage1 --threads 1
#   cp $FILES_AT/run/* runs/tiny-arena-vl-v3.1/ && python -m training.train_arena_v31 --threads 1
# goes on on the CPU from where the GPU stopped (the flags that shape the recipe are the defaults).
set -euo pipefail
minutes=${1:-8}
stage=${2:-v3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
mkdir -p "$OUT/run"
if [ "$stage" = v31 ]; then
  if [ -d runs/tiny-arena-vl-v3.1 ]; then cp runs/tiny-arena-vl-v3.1/* "$OUT/run/"; fi
  python3 -m training.train_arena_v31 --out "$OUT/run" --device cuda --workers 13 --threads 3 \
    --minutes "$minutes" 2>&1 | tee "$OUT/train.log"
else
  if [ -d runs/tiny-arena-vl-v3 ]; then cp runs/tiny-arena-vl-v3/* "$OUT/run/"; fi
  python3 -m training.train_arena_v3 --eyes training/stage1 --out "$OUT/run" --device cuda --workers 13 --threads 3 \
    --eval-items 80 --minutes "$minutes" 2>&1 | tee "$OUT/train.log"
fi
