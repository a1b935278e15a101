"""Accuracy under a fixed memory cap (``--mode stream --accuracy``): the bundled offline model's
held-out video questions streamed into the cache a few frames at a time, each capped method under
caps that are fractions of the full cache's bytes for the same video, against the full cache
streamed without a cap (which equals the one-prompt prefill).

    python -m kv_arena.bench --mode stream --accuracy --items 200 --caps 0.1,0.25,0.5 \\
        --methods full,infinipot_v,streamingllm,snapkv

The items are the "moving" video questions of the served generation (kv_arena/tiny/generations.py:
"Which shape moves?"), one question each, asked once the whole video has streamed (the method
never sees it: a streamed video is compressed before anyone asks). Chunks of ``--frames-per-chunk``
frames (default 2: one temporal group of Qwen2.5-VL), so a cap bites while the video streams in.
An answer counts when it is the expected answer whole, as in ``--mode accuracy``
(:func:`kv_arena.bench.accuracy.judge`), with its 95% Wilson interval; per row also the share of
answers equal to the full cache's, and the KV held at most while a chunk went in and at the end
of the video, over the full cache's at the end of the video. A cap below what a method never
evicts is refused (InfiniPot-V keeps the prompt's text whole): that item counts wrong, and the
share refused is a column.
"""

from __future__ import annotations

import numpy as np

from kv_arena import backends

from ..errors import UserError
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import ARENA, load_model
from ..runtime.streaming import feed_streaming
from ..tiny import generations
from .accuracy import Verdict, answer_budget, judge
from .accuracy_report import wilson
from .common import REFERENCE, aligned

KIND = "moving"  # the scenes' video questions
DEFAULT_FRAMES_PER_CHUNK = 2


def caps_of(text: str) -> list[float]:
    try:
        caps = sorted(float(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise UserError(f"--caps must be comma-separated fractions of the full cache; got {text!r}") from None
    if not caps or any(not 0 < c < 1 for c in caps):
        raise UserError(f"--caps must lie in (0, 1), fractions of the full cache's bytes; got {text}")
    return caps


def streamed_answer(loaded, method: str, item, cap_bytes: int | None, frames_per_chunk: int) -> dict:
    """The item's video streamed under ``cap_bytes``, then its question: the answer, its verdict,
    and the KV bytes at the end of the video and at most while a chunk went in."""
    conv = Conversation(loaded, backends.make_backend(method))
    try:
        progress = list(feed_streaming(conv, Message("", **item.media()), frames_per_chunk, cap_bytes))
    except UserError:  # a cap below what the method never evicts (InfiniPot-V: all but video frames): no answer
        return {"text": None, "verdict": Verdict(False, False), "video_bytes": None, "peak_bytes": None}
    q = item.question
    text = conv.ask(Message(q.text), max_new_tokens=answer_budget(q.answer)).text
    return {"text": text, "verdict": judge(text, q.answer), "video_bytes": progress[-1].kv_bytes,
            "peak_bytes": max(p.peak_kv_bytes for p in progress)}


def summary(method: str, fraction: float | None, runs: list[dict], full: list[dict]) -> dict:
    """A row: the share right (a refused cap counts wrong) with its interval, the share answered as
    the full cache answered, the share refused, and the KV held over the full cache's (answered items)."""
    hits = sum(r["verdict"].right for r in runs)
    low, high = wilson(hits, len(runs))
    held = [(r, f) for r, f in zip(runs, full) if r["text"] is not None]
    return {"method": method, "cap_fraction": fraction, "n": len(runs), "right": hits / len(runs),
            "right_low": low, "right_high": high, "ran_on": float(np.mean([r["verdict"].ran_on for r in runs])),
            "same_as_full": float(np.mean([r["text"] == f["text"] for r, f in zip(runs, full)])),
            "refused": 1 - len(held) / len(runs),
            "peak_fraction": float(np.mean([r["peak_bytes"] / f["video_bytes"] for r, f in held])) if held else None,
            "end_fraction": float(np.mean([r["video_bytes"] / f["video_bytes"] for r, f in held])) if held else None}


def run(args, methods: list[str]) -> list[dict]:
    """One row for the full cache, then one per capped method and cap."""
    if args.items < 1:
        raise UserError(f"--items must be at least 1; got {args.items}")
    caps = caps_of(args.caps)
    chunk = args.frames_per_chunk or DEFAULT_FRAMES_PER_CHUNK
    generation = generations.of()
    items = generation.scenes.held_out(KIND, args.items)
    loaded = load_model(args.model or ARENA)
    full = [streamed_answer(loaded, REFERENCE, it, None, chunk) for it in items]
    rows = [summary(REFERENCE, None, full, full) | {"model": args.model or ARENA, "generation": generation.number}]
    for method in (m for m in methods if m != REFERENCE):
        for fraction in caps:
            runs = [streamed_answer(loaded, method, it, int(fraction * f["video_bytes"]), chunk)
                    for it, f in zip(items, full)]
            rows.append(summary(method, fraction, runs, full))
    return rows


def table(rows: list[dict]) -> str:
    head = rows[0]
    cells = [["method", "cap (of full)", "peak KV (of full)", "KV at end (of full)", "right (95% CI)",
              "same as full", "ran on", "cap refused"]]
    for r in rows:
        cells.append([r["method"], "-" if r["cap_fraction"] is None else f"{r['cap_fraction']:.2f}",
                      *("-" if r[k] is None else f"{r[k]:.2f}" for k in ("peak_fraction", "end_fraction")),
                      f"{r['right']:.2f} ({r['right_low']:.2f}-{r['right_high']:.2f})",
                      f"{r['same_as_full']:.2f}", f"{r['ran_on']:.2f}", f"{r['refused']:.2f}"])
    return (f"{head['model']} (scenes v{head['generation']}): {head['n']} held-out '{KIND}' videos, streamed, "
            "then asked; whole answers right\n" + "\n".join(aligned(cells)))
