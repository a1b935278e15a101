# Sourced by the long, resumable scripts (training/ship_v31.sh, tools/accuracy_table.sh): one step,
# run once. Needs $OUT, the folder of the steps' outputs and .done marks.

step() {  # step NAME COMMAND...: run once, its output in $OUT/NAME.txt; a step whose $OUT/NAME.done exists is skipped
    local name=$1
    shift
    if [ -e "$OUT/$name.done" ]; then
        echo "$name: done before ($(cat "$OUT/$name.done"))"
        return
    fi
    echo "$name: $* ($(date -u +%H:%M))"
    "$@" > "$OUT/$name.txt" 2>&1 || { echo "$name failed: see $OUT/$name.txt" >&2; exit 1; }
    date -u > "$OUT/$name.done"
}
