"""``python -m kv_arena.bench``: the methods-against-the-full-cache benchmark (:mod:`.methods`), or with
``--mode NAME`` another benchmark, each with its own flags."""

from __future__ import annotations

import importlib
import sys

# modes with their own CLI; imported only when chosen (the accuracy bench pulls in plotly)
MODES = {"mpic": "kv_arena.bench.mpic", "prefill": "kv_arena.bench.prefill", "accuracy": "kv_arena.bench.accuracy",
         "decode": "kv_arena.bench.decode", "stream": "kv_arena.bench.stream",
         "gpu-check": "kv_arena.bench.gpu_check", "capacity": "kv_arena.bench.capacity"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mode" in argv:  # e.g. --mode mpic: TTFT of media reuse vs. number of images
        i = argv.index("--mode")
        mode = argv[i + 1] if i + 1 < len(argv) else ""
        if mode not in MODES:
            print(f"error: unknown --mode '{mode}'; choose from: {', '.join(MODES)}", file=sys.stderr)
            return 2
        return importlib.import_module(MODES[mode]).main(argv[:i] + argv[i + 2:])
    from .methods import main as methods_main

    return methods_main(argv)
