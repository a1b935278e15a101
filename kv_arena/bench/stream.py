"""Long videos at a fixed memory cap: a video streamed into a real architecture (random weights,
vision tower and decoder), frames 16 -> 1,024, each method under one cap against the full cache.

    python -m kv_arena.bench --mode stream --model random:Qwen/Qwen2-VL-2B-Instruct --num-layers 2 \\
        --vision-layers 1 --frames 16,64,256,1024 --frame-size 112 --cap-mb 2 \\
        --methods full,infinipot_v,streamingllm,snapkv

Each (method, frame count) runs in a fresh process, so its peak resident memory is its own: the
model loads, the synthetic video (drifting noise, ``--frame-size`` px square frames, each sized as
one image of that size whatever the video's length) is drawn, the peak resident set is reset
(Linux ``/proc/self/clear_refs``), then the video streams in chunks of ``--frames-per-chunk``
frames (pixels, vision tower, prefill, the method's eviction), a question follows and
``--decode-steps`` tokens are generated. The full cache streams without a cap.

Per row: the KV bytes held at the end of the video and at most while any chunk went in (peak),
the process's peak resident memory over the stream and the answer (model, frames and Python
included), the streamed prefill's time per frame, and the median decode step after the video.
Small frames and a shallow model keep a 1,024-frame run to minutes on a CPU.

With ``--accuracy``: the offline model's held-out video questions answered under ``--caps``
(fractions of the full cache), per capped method, against the full cache (:mod:`.stream_accuracy`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from kv_arena import backends

from ..errors import UserError
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import load_model
from ..runtime.streaming import feed_streaming, synthetic_video
from . import stream_accuracy
from .common import REFERENCE, add_run_args, aligned, run_main

MB = 2**20
SCALING_MODEL = "random:Qwen/Qwen2-VL-2B-Instruct"
FRAMES_PER_CHUNK = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode stream", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a random:<repo> or tiny model (default: "
                   "random:Qwen/Qwen2-VL-2B-Instruct; with --accuracy, the offline tiny-arena-vl)")
    p.add_argument("--num-layers", type=int, default=2, help="decoder depth")
    p.add_argument("--vision-layers", type=int, default=1, help="vision tower depth")
    p.add_argument("--frames", default="16,64,256,1024", help="comma-separated frame counts")
    p.add_argument("--frame-size", type=int, default=112, help="square frames of this many pixels")
    p.add_argument("--frames-per-chunk", type=int, default=None, help="default 16 (with --accuracy: 2)")
    p.add_argument("--cap-mb", type=float, default=2.0, help="the KV cap of every method but the full cache")
    p.add_argument("--methods", default="full,infinipot_v,streamingllm,snapkv")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--accuracy", action="store_true", help="answers right under --caps against the full cache")
    p.add_argument("--caps", default="0.1,0.25,0.5", help="with --accuracy: caps, fractions of the full cache's bytes")
    p.add_argument("--items", type=int, default=200, help="with --accuracy: held-out videos")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # METHOD:FRAMES, run in this process
    add_run_args(p)
    return p.parse_args(argv)


def peak_rss_bytes() -> int:
    """The process's peak resident set since the last reset (VmHWM), else since it started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_one(args, method: str, frames: int) -> dict:
    loaded = load_model(args.model or SCALING_MODEL, device=args.device, dtype=args.dtype, num_layers=args.num_layers,
                        vision_layers=args.vision_layers, seed=args.seed)
    cap = None if method == REFERENCE else int(args.cap_mb * MB)
    video = synthetic_video(frames, size=args.frame_size, seed=args.seed)
    conv = Conversation(loaded, backends.make_backend(method))
    message = Message("", videos=[video], num_frames=frames)
    reset_peak_rss()
    base_rss = peak_rss_bytes()
    start = time.perf_counter()
    chunk = args.frames_per_chunk or FRAMES_PER_CHUNK
    progress = list(feed_streaming(conv, message, frames_per_chunk=chunk, cap_bytes=cap, frame_max_pixels=args.frame_size**2))
    done = [0] + [p.frames_done for p in progress]
    video_s = sum(p.chunk_s for p, before in zip(progress, done) if p.frames_done > before)  # chunks with frames
    prefill_s = time.perf_counter() - start
    update = conv.ask(Message("What happens in the video?"), max_new_tokens=args.decode_steps + 1, ignore_eos=True)
    return {"model": args.model or SCALING_MODEL, "method": method, "frames": frames, "cap_bytes": cap,
            "video_tokens": sum(v.length for layout in conv.layouts for v in layout.videos),
            "chunks": len(progress), "kv_bytes_end_of_video": progress[-1].kv_bytes,
            "peak_kv_bytes": max(p.peak_kv_bytes for p in progress),
            "largest_chunk_bytes": max(p.peak_kv_bytes - prev.kv_bytes for prev, p in zip(progress, progress[1:])),
            "rss_before_bytes": base_rss, "peak_rss_bytes": peak_rss_bytes(),
            "prefill_s": prefill_s, "prefill_ms_per_frame": 1000 * video_s / frames,
            "decode_step_ms": 1000 * statistics.median(update.metrics.step_s)}


def run(args) -> list[dict]:
    frames = [int(f) for f in args.frames.split(",") if f.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m != REFERENCE and not backends.backend_class(m).streams_under_cap:
            raise UserError(f"{m} does not stream under a cap; choose from: "
                            + ", ".join(n for n in backends.available() if backends.backend_class(n).streams_under_cap))
    if args.accuracy:
        return stream_accuracy.run(args, methods)
    if args.one:
        method, count = args.one.split(":")
        return [run_one(args, method, int(count))]
    rows = []
    for count in frames:
        for method in methods:
            cmd = [sys.executable, "-m", "kv_arena.bench", "--mode", "stream", *args.argv, "--one", f"{method}:{count}", "--json"]
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            if out.returncode:
                raise UserError(f"{method} at {count} frames failed: {out.stderr.strip().splitlines()[-1:]}")
            row = json.loads(out.stdout)[0]
            rows.append(row)
            if not args.json:
                print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)  # progress, as measured
    return rows


def table(rows: list[dict]) -> str:
    if rows and "right" in rows[0]:
        return stream_accuracy.table(rows)
    cells = [["frames", "method", "video tokens", "cap MB", "peak KV MB", "KV MB at end", "peak RSS MB",
              "prefill ms/frame", "decode ms/step"]]
    for r in rows:
        cells.append([str(r["frames"]), r["method"], str(r["video_tokens"]),
                      "-" if r["cap_bytes"] is None else f"{r['cap_bytes'] / MB:.2f}",
                      f"{r['peak_kv_bytes'] / MB:.2f}", f"{r['kv_bytes_end_of_video'] / MB:.2f}",
                      f"{r['peak_rss_bytes'] / MB:.0f}", f"{r['prefill_ms_per_frame']:.1f}",
                      f"{r['decode_step_ms']:.1f}"])
    return "\n".join(aligned(cells))


def main(argv=None) -> int:
    def parse(a):
        args = parse_args(a)
        args.argv = [x for x in (sys.argv[1:] if a is None else list(a)) if x != "--json"]  # for each child run
        return args

    return run_main(parse, run, table, argv)
