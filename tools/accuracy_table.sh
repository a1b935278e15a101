#!/usr/bin/env bash
# The accuracy table of docs/benchmarks.md (assets/accuracy.*): the full cache and SnapKV, then each
# method added on the same chats, every chat's verdict kept (so `--paired A,B` can decide "beats").
# Resumable: a step whose OUT/STEP.done exists is not run again, so rerun the same command after a
# stop; a stop loses one method at most. Each step's output: OUT/STEP.txt.
#
#   bash tools/accuracy_table.sh [OUT]            # OUT: a folder (default runs/accuracy-table)
#   PART=tail bash tools/accuracy_table.sh [OUT]  # beside it on a second core: the methods from the
#                                                 # last, on a copy of the run (OUT/accuracy-tail.json)
#
# The head waits for the tail's methods and merges their rows; after a stop, start both again: each
# goes on from the method it had claimed.
#
# The bundled weights unless KV_ARENA_TINY_DIR names others. Copy OUT/accuracy.{json,html,png} into
# assets/ to commit the run (the PNG is drawn only where kaleido is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/accuracy-table}
export OMP_NUM_THREADS=${THREADS:-${OMP_NUM_THREADS:-1}}  # ship_v31.sh sets its own
mkdir -p "$OUT"

source tools/steps.sh

ROW=(--budgets 0.2 --per-type 34 --no-probe)
METHODS="elastic_cache mpic vl_cache zipvl attention_pack streamingllm h2o pyramidkv adakv infinipot_v kivi fastv
         random downsample evs"
PART=${PART:-head}
mine() {  # mine M: M is this chain's to measure (claimed now, or by this chain before a stop)
    ( set -o noclobber; echo "$PART" > "$OUT/accuracy-$1.claim" ) 2> /dev/null || [ "$(cat "$OUT/accuracy-$1.claim")" = "$PART" ]
}
if [ "$PART" = tail ]; then
    until [ -e "$OUT/accuracy-snapkv.done" ]; do sleep 60; done  # the chats come from the head's first step
    [ -e "$OUT/accuracy-tail.json" ] || cp "$OUT/accuracy.json" "$OUT/accuracy-tail.json"
    for m in $(echo $METHODS | tr ' ' '\n' | tac); do
        mine "$m" || continue
        step "accuracy-$m" python -m kv_arena.bench --mode accuracy --add "$OUT/accuracy-tail.json" --methods "$m" \
            "${ROW[@]}" --no-figure
    done
    exit 0
fi
step accuracy-snapkv python -m kv_arena.bench --mode accuracy --per-type 34 --budgets 0.2 --methods snapkv \
    --out "$OUT/accuracy"
for m in $METHODS; do
    mine "$m" || continue
    step "accuracy-$m" python -m kv_arena.bench --mode accuracy --add "$OUT/accuracy.json" --methods "$m" "${ROW[@]}"
done
if [ -e "$OUT/accuracy-tail.json" ]; then  # the tail's rows, once it has measured them, and the figure redrawn
    for m in $METHODS; do until [ -e "$OUT/accuracy-$m.done" ]; do sleep 60; done; done
    step accuracy-merge python -m kv_arena.bench --mode accuracy --add "$OUT/accuracy.json" \
        --from-json "$OUT/accuracy-tail.json"
fi
echo "measured: $OUT/accuracy.json"
