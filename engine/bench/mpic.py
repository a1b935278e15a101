"""MPIC's figure of merit (Sec. 6.3, Fig. 10): time to first token against the number of images.

    python -m engine.bench --mode mpic --model random:Qwen/Qwen2-VL-2B-Instruct --max-images 8 --k 32 --json

For 1 to ``--max-images`` images whose KV is already in the store, the question is changed *ahead*
of the images (the case prefix caching cannot reuse: an earlier request asked something else about
the same images), and each mode answers one token: full recompute, prefix caching, full reuse,
CacheBlend-r and MPIC-k. TTFTs are medians over ``--repeats`` runs, printed as ratios to full
recompute, with whether the first token matches full recompute's. Exit code 2 on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace

import backends

from ..errors import UserError
from ..mpic.kv_store import KVStore
from ..mpic.linking import ingest
from ..mpic.ttft import time_prompt
from ..runtime.inputs import Message
from ..runtime.models import load_model
from .common import add_run_args, aligned, run_main
from .methods import synthetic_images

MODES = ("recompute", "prefix", "full_reuse", "cacheblend", "mpic")
EARLIER = "Describe these pictures one by one."
QUESTION = "Which of these pictures is the brightest, and why?"
SESSION = "bench"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench --mode mpic", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:Qwen/Qwen2-VL-2B-Instruct")
    p.add_argument("--max-images", type=int, default=8, help="measure 1 .. this many images")
    p.add_argument("--counts", default=None, help="comma-separated image counts instead of 1..max (e.g. 1,2,4,8)")
    p.add_argument("--k", type=int, default=32, help="MPIC-k: image tokens recomputed per image")
    p.add_argument("--ratio", type=float, default=0.15, help="CacheBlend-r: share of tokens recomputed")
    p.add_argument("--image-size", type=int, default=448, help="side of the synthetic images in pixels")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the median TTFT is reported")
    p.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    p.add_argument("--num-layers", type=int, default=None, help="override the decoder depth (random/tiny models)")
    add_run_args(p)
    return p.parse_args(argv)


def _median_run(loaded, store, message: Message, mode: str, repeats: int, params: dict, tag: str) -> dict:
    runs = []
    for r in range(repeats):
        session = SESSION
        if mode == "prefix":  # a fresh session whose only earlier request asked something else
            session = f"{SESSION}-{tag}-{r}"
            time_prompt(loaded, store, session, replace(message, text=EARLIER), mode)
        runs.append(time_prompt(loaded, store, session, message, mode, **params))
        if mode == "prefix":
            store.drop_session(session)
    return dict(runs[-1], ttft_s=statistics.median(r["ttft_s"] for r in runs))


def run(args: argparse.Namespace) -> list[dict]:
    counts = [int(c) for c in args.counts.split(",")] if args.counts else list(range(1, args.max_images + 1))
    if not counts or min(counts) < 1 or args.repeats < 1:
        raise UserError("image counts and --repeats must be positive")
    params = {"k": args.k, "recompute_ratio": args.ratio}
    backends.make_backend("mpic", **params)  # bad values fail before the model loads
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, num_layers=args.num_layers, seed=args.seed)
    store = KVStore(args.store or tempfile.mkdtemp(prefix="kv-arena-mpic-"))
    images = synthetic_images(max(counts), args.image_size)
    for i, image in enumerate(images):  # the uploads: stored before any question
        ingest(loaded, store, SESSION, image, label=f"image {i + 1}")
    store.flush()  # no disk writes in the background of the timings
    warm_up = Message(QUESTION, images=images[:1], media_first=False)
    for mode in MODES:
        _median_run(loaded, store, warm_up, mode, 1, params, "warm-up")

    rows = []
    for n in counts:
        message = Message(QUESTION, images=images[:n], media_first=False)
        figures = {m: _median_run(loaded, store, message, m, args.repeats, params, str(n)) for m in MODES}
        base = figures["recompute"]
        rows.append({"images": n, "prompt_tokens": base["prompt_tokens"], "recompute_ttft_s": base["ttft_s"],
                     **{f"{m}_ratio": figures[m]["ttft_s"] / base["ttft_s"] for m in MODES[1:]},
                     **{f"{m}_same_first_token": figures[m]["first_token"] == base["first_token"] for m in MODES[1:]},
                     "ttft_s": {m: f["ttft_s"] for m, f in figures.items()},
                     "linked": figures["mpic"]["status"], "model": args.model, "k": args.k, "ratio": args.ratio})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"model {rows[0]['model']}: TTFT as a ratio to full recompute, images' KV stored, question changed "
            f"ahead of the images (MPIC-{rows[0]['k']}, CacheBlend-{rows[0]['ratio'] * 100:g}%)")
    names = ["images", "tokens", "recompute s", "prefix", "full reuse", "cacheblend", "mpic"]
    cells = [names] + [[str(r["images"]), str(r["prompt_tokens"]), f"{r['recompute_ttft_s']:.3f}"]
                       + [f"{r[m + '_ratio']:.2f}" + ("" if r[m + "_same_first_token"] else "*") for m in MODES[1:]]
                       for r in rows]
    lines = aligned(cells)
    return "\n".join([head] + lines + ["* first token differs from full recompute's"])


def main(argv=None) -> int:
    return run_main(parse_args, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
