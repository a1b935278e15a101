#!/usr/bin/env bash
# Re-resolve requirements-lock.txt: the newest versions requirements-dev.txt admits, installed in a
# fresh virtual environment (torch held at the CPU wheel), written as exact pins.
#     bash tools/refresh_lock.sh        # then run .ci/run and commit the lock with what it changed
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q -r requirements-dev.txt -c .ci/cpu-torch.txt
{
  echo "# Exact versions of everything requirements-dev.txt pulls in, resolved $(date -u +%Y-%m-%d) by"
  echo "# tools/refresh_lock.sh on Python $("$work/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])'); the README's commands and .ci/run install with -c this file."
  # a local build tag (torch's +cpu) is dropped: ==2.13.0 admits the CPU wheel and a CUDA one alike
  "$work/venv/bin/pip" freeze | sed -E 's/\+[a-z0-9.]+$//' | LC_ALL=C sort -f
} > requirements-lock.txt
echo "requirements-lock.txt: $(grep -vc '^#' requirements-lock.txt) packages"
