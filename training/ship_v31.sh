#!/usr/bin/env bash
# Ship tiny-arena-vl v3.1 (issue #57) and measure again every figure the docs took from the bundled
# weights, with the commands the docs name. Resumable: a step whose runs/ship-v31/STEP.done exists is
# not run again, so rerun the same command after a stop. Each step's output: runs/ship-v31/STEP.txt.
#
#   bash training/ship_v31.sh [RUN]      # RUN: the v3.1 run's folder (default runs/tiny-arena-vl-v3.1)
#   THREADS=1 bash training/ship_v31.sh  # beside other work on a 2-core machine
#   PART=video THREADS=1 bash training/ship_v31.sh RUN   # stream accuracy and the long-video demo only,
#                                        # beside the whole script (THREADS=1 too) on a 2-core machine
#   PART=accuracy-tail THREADS=1 bash training/ship_v31.sh RUN   # the accuracy methods from the last
#                                        # (tools/accuracy_table.sh's second chain)
#
# It stops at the first step that fails, and at the shipping bar (probe_v31 --bar exits 1 below it):
# nothing is measured on weights that do not meet it. Then, by hand, from the outputs:
# - the model card (assets/tiny-arena-vl/README.md): how v3.1 was trained, what it answers (drawn
#   any way, asked before, long videos and how to send them, photos), bar.txt's and card.txt's tables;
# - generations.py's ``reads`` (the app's About) and tools/long_video.py's default --question (glimpse);
# - docs/benchmarks.md (accuracy, stream accuracy, long videos, the app's cost), docs/offline-model.md
#   ("bundled" now means v3.1), README.md's snippet answers and screenshot alt text;
# - the whole suite: the tests that pin the bundled model's answers (test_tiny_vlm.py,
#   test_app_client.py, test_app_events.py, test_app_compare.py...) say what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/tiny-arena-vl-v3.1}
OUT=runs/ship-v31
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"
if pgrep -f "training.train_arena_v31" > /dev/null; then  # the bar and the copy must see the same weights
    echo "v3.1's training is still running: ship its weights once it has stopped" >&2
    exit 1
fi

source tools/steps.sh

# 1. the shipping bar on the run's weights, and the model card's tables (nothing is measured below it)
step bar python -m training.probe_v31 "$RUN" --bar --items 200 --long-items 40 --threads "$THREADS"
step over python -m training.probe_v31 "$RUN" --over 1,3,5,7.5,10 --long-items 40 --threads "$THREADS"

# Every measurement below serves the run's weights (KV_ARENA_TINY_DIR) and writes under $OUT, so a
# stop between sessions leaves the committed assets as they were; they are copied in at the end.
export KV_ARENA_TINY_DIR
KV_ARENA_TINY_DIR=$(realpath "$RUN")

# 2. the card's scenes drawn by code of their own, asked through the app
step card python -m training.card_check --items 80 --bar --threads "$THREADS"

# 3. video: answers under a cap, and the long-video demo through the app (v3.1's long videos, and
#    v3's scene slowed to 10 minutes, the docs' earlier table); PART=video runs only these,
#    beside the rest
video() {
step stream python -m kv_arena.bench --mode stream --accuracy --items 200 --caps 0.1,0.25,0.5 \
    --methods full,infinipot_v,streamingllm,snapkv
for q in glimpse long_moving moving; do
    step "long-$q" python -m tools.long_video --question "$q" --methods full,infinipot_v,streamingllm,snapkv --videos 8
done
for q in glimpse long_moving; do  # the issue's shortest long video: its time ids half as far apart
    step "long-$q-5min" python -m tools.long_video --question "$q" --minutes 5 \
        --methods full,infinipot_v,streamingllm,snapkv --videos 8
done
}

if [ "${PART:-all}" = video ]; then
    video
    exit 0
fi

# 4. the accuracy table and figure (docs/benchmarks.md), resumable, in two chains on two cores:
#    tools/accuracy_table.sh; PART=accuracy-tail runs its second chain
if [ "${PART:-all}" = accuracy-tail ]; then
    PART=tail bash tools/accuracy_table.sh "$OUT/accuracy-table"
    exit 0
fi
PART=head bash tools/accuracy_table.sh "$OUT/accuracy-table"

video  # done before where PART=video ran beside this

# 5. what the app itself costs
step app-cost python -m tools.app_cost --repeats 5 --methods full,snapkv,h2o,streamingllm

# 6. the weights and the accuracy run into assets/, then the README's screenshot and its API snippet
unset KV_ARENA_TINY_DIR
if [ ! -e "$OUT/assets.done" ]; then
    cp "$RUN/model.safetensors" "$RUN/config.json" "$RUN/training_curve.json" assets/tiny-arena-vl/
    for ext in json html png; do  # the PNG only where kaleido drew it
        if [ -e "$OUT/accuracy-table/accuracy.$ext" ]; then cp "$OUT/accuracy-table/accuracy.$ext" assets/; fi
    done
    python -m kv_arena.bench --mode accuracy --from-json assets/accuracy.json > "$OUT/accuracy-tables.txt" 2>&1
    date -u > "$OUT/assets.done"
fi
step screenshot env KV_ARENA_UPDATE_SCREENSHOT=1 python -m pytest -q tests/test_app_browser.py \
    -k a_fresh_page_compares_an_example_conversation_with_marks
step readme-snippet python -m pytest -q tests/test_app_client.py -k readmes_api_snippet
echo "all measured: $OUT"
