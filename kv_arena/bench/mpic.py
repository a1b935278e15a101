"""MPIC's figure of merit (Sec. 6.3, Fig. 10): time to first token against the number of images.

    python -m kv_arena.bench --mode mpic --model random:Qwen/Qwen2-VL-2B-Instruct --num-layers 2 \\
        --vision-layers 2 --counts 1,4,8 --k 32 --json

For each count of images whose KV is already in the store, the question is changed *ahead* of the
images (the case prefix caching cannot reuse: an earlier request asked something else), and each
mode answers one token: full recompute, prefix caching, full reuse, CacheBlend-r and MPIC-k. Per
count, ``--repeats`` rounds run every mode once, in an order rotated per round; each mode's TTFT
is divided by full recompute's of the same round, and the median of those ratios is printed with
their min-max (marked where it crosses 1). Each count's rows are printed as soon as they are
measured, with the TTFT's parts (:func:`kv_arena.mpic.ttft.time_prompt`): the vision encoder,
linking, the language model's passes (``prefill`` where nothing is linked, ``recompute`` for
the modes that link stored KV) and the rest. The earlier request of prefix caching is text only: it
shares the same prefix with the question (the system prompt and the turn's header), so the reuse is
that of an earlier request about the same images, without encoding them once more.

``--vision-layers N`` cuts the random-weight vision encoder to N blocks, as ``--num-layers`` cuts
the decoder: at full depth (Qwen2-VL: 32 blocks of width 1,280, about 20 G multiply-adds each for
the 1,024 patches of a 448 px image) encoding dominates every mode that encodes and a CPU run is
long. Cutting both by about the same factor (2 of 32 blocks, 2 of 28 layers) keeps the full
model's balance between the two per image: about 2 : 1 in multiply-adds (encoder : decoder's
matrices over the image's 256 tokens), 655 G : 335 G at full size, 50 G : 24 G cut. Exit code 2
on bad input.

``--store-url redis://host:port/db`` (or ``auto``: a throwaway local ``valkey-server`` or
``redis-server``; default ``KV_ARENA_KV_STORE_URL``) adds the row ``server``: MPIC-k on images
that another process stored on that Valkey/Redis server, read by a replica whose local tier is
empty (a new one per round), so its TTFT holds the lookups and the layer-by-layer loads the
forward pass overlaps (:class:`~kv_arena.mpic.server_store.ServerStore`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
from contextlib import contextmanager

import torch

from ..errors import UserError
from ..mpic.kv_store import KVStore
from ..mpic.linking import ingest
from ..mpic.store_api import MediaStore
from ..mpic.ttft import reuse_method, time_prompt
from ..runtime.inputs import Message
from ..runtime.models import load_model
from .common import SPREAD_NOTE, Spread, add_repeats_arg, add_run_args, check_repeats, rotated, run_main
from .methods import synthetic_images

MODES = ("recompute", "prefix", "full_reuse", "cacheblend", "mpic")
SERVER = "server"  # MPIC-k on images another process stored on a shared server (--store-url)
LINKING = ("full_reuse", "cacheblend", "mpic", SERVER)  # their language-model passes recompute part of a linked cache
PARTS = ("vision_s", "linking_s", "lm_s", "other_s", "new_kv_tokens")
EARLIER = "Describe these pictures one by one."
QUESTION = "Which of these pictures is the brightest, and why?"
SESSION = "bench"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode mpic", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:Qwen/Qwen2-VL-2B-Instruct")
    p.add_argument("--max-images", type=int, default=8, help="measure 1 .. this many images")
    p.add_argument("--counts", default=None, help="comma-separated image counts instead of 1..max (e.g. 1,2,4,8)")
    p.add_argument("--k", type=int, default=32, help="MPIC-k: image tokens recomputed per image")
    p.add_argument("--ratio", type=float, default=0.15, help="CacheBlend-r: share of tokens recomputed")
    p.add_argument("--image-size", type=int, default=448, help="side of the synthetic images in pixels")
    add_repeats_arg(p)
    p.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    p.add_argument("--store-url", default=os.environ.get("KV_ARENA_KV_STORE_URL") or None,
                   help="a Valkey/Redis server (redis://host:port/db), or 'auto' to start a throwaway one: "
                        "adds the row 'server' (images stored there by another process)")
    p.add_argument("--num-layers", type=int, default=None, help="override the decoder depth (random/tiny models)")
    p.add_argument("--vision-layers", type=int, default=None,
                   help="cut the vision encoder to this many blocks (random/tiny models; e.g. 2 on a CPU)")
    add_run_args(p)
    return p.parse_args(argv)


def image_counts(args: argparse.Namespace) -> list[int]:
    try:
        counts = [int(c) for c in args.counts.split(",") if c.strip()] if args.counts else list(range(1, args.max_images + 1))
    except ValueError:
        raise UserError(f"--counts expects comma-separated integers, got '{args.counts}'") from None
    if not counts or min(counts) < 1:
        raise UserError("image counts must be positive")
    return counts


def time_mode(loaded, store: MediaStore, message: Message, mode: str, params: dict, tag: str,
              url: str | None = None) -> dict:
    """One timed answer token of ``mode``; prefix caching runs in a fresh session whose only earlier
    request asked something else (text only: the prefix it shares with the question is the same);
    ``server`` reads the server at ``url`` through a new replica's store (an empty local tier)."""
    if mode == SERVER:
        return time_on_replica(loaded, url, message, params)
    if mode != "prefix":
        return time_prompt(loaded, store, SESSION, message, mode, **params)
    session = f"{SESSION}-{tag}"
    time_prompt(loaded, store, session, Message(EARLIER), mode)
    try:
        return time_prompt(loaded, store, session, message, mode, **params)
    finally:
        store.drop_session(session)


def time_on_replica(loaded, url: str, message: Message, params: dict) -> dict:
    """MPIC-k as a new replica answers: nothing local, everything from the server."""
    from ..mpic.server_store import ServerStore  # the client library is needed only with a server

    local = tempfile.mkdtemp(prefix="kv-arena-replica-")
    try:
        store = ServerStore(url, KVStore(local))  # connects now, before the clock runs
        if store.health_note():
            raise UserError(f"--store-url {url}: {store.health_note()}")
        return time_prompt(loaded, store, SESSION, message, "mpic", **params)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def fill_server(url: str, model_args: dict, count: int, size: int) -> None:
    """The other process: loads the same model and stores the images' KV on the server."""
    from ..mpic.server_store import ServerStore

    loaded = load_model(**model_args)
    local = tempfile.mkdtemp(prefix="kv-arena-writer-")
    store = ServerStore(url, KVStore(local))
    for i, image in enumerate(synthetic_images(count, size)):
        ingest(loaded, store, SESSION, image, label=f"image {i + 1}")
    store.flush()
    shutil.rmtree(local, ignore_errors=True)
    if store.health_note():
        raise SystemExit(store.health_note())


@contextmanager
def shared_server(args: argparse.Namespace, model_args: dict, count: int):
    """The server's URL with the images stored there by another process (None without --store-url)."""
    if not args.store_url:
        yield None
        return
    local = None
    if args.store_url == "auto":
        from .valkey_server import LocalServer

        try:
            local = LocalServer()
        except FileNotFoundError as exc:
            raise UserError(f"--store-url auto: {exc}") from None
    url = local.url if local else args.store_url
    try:
        writer = multiprocessing.get_context("spawn").Process(target=fill_server,
                                                              args=(url, model_args, count, args.image_size))
        writer.start()
        writer.join()
        if writer.exitcode != 0:
            raise UserError(f"--store-url: the process storing the images on {url} failed (exit {writer.exitcode})")
        yield url
    finally:
        if local:
            local.stop()


def vision_depth(loaded) -> int:
    vision = loaded.model.config.vision_config
    return getattr(vision, "depth", None) or vision.num_hidden_layers


def run(args: argparse.Namespace):
    """Yields one row per image count, as soon as it is measured."""
    counts = image_counts(args)
    check_repeats(args.repeats)
    params = {"k": args.k, "recompute_ratio": args.ratio}
    reuse_method(**params)  # bad values fail before the model loads
    model_args = {"name": args.model, "device": args.device, "dtype": args.dtype, "num_layers": args.num_layers,
                  "seed": args.seed, "vision_layers": args.vision_layers}
    with shared_server(args, model_args, max(counts)) as url:
        loaded = load_model(**model_args)
        store = KVStore(args.store or tempfile.mkdtemp(prefix="kv-arena-mpic-"))
        images = synthetic_images(max(counts), args.image_size)
        for i, image in enumerate(images):  # the uploads: stored before any question
            ingest(loaded, store, SESSION, image, label=f"image {i + 1}")
        store.flush()  # no disk writes in the background of the timings
        modes = MODES + ((SERVER,) if url else ())
        warm_up = Message(QUESTION, images=images[:1], media_first=False)
        for mode in modes:
            time_mode(loaded, store, warm_up, mode, params, "warm-up", url)
        setup = {"model": args.model, "layers": loaded.num_layers, "vision_layers": vision_depth(loaded),
                 "vision_cut": bool(args.vision_layers), "device": str(loaded.device),
                 "dtype": str(loaded.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                 "k": args.k, "ratio": args.ratio, "repeats": args.repeats, "modes": list(modes)}
        for n in counts:
            message = Message(QUESTION, images=images[:n], media_first=False)
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for r in range(args.repeats):  # every mode once per round, so drift hits them alike
                for mode in rotated(modes, r):
                    runs[mode].append(time_mode(loaded, store, message, mode, params, f"{n}-{r}", url))
            yield count_row(n, runs) | setup


def count_row(n: int, runs: dict[str, list[dict]]) -> dict:
    """One image count's figures: TTFT ratios to full recompute (paired per round), medians of the parts."""
    base = [f["ttft_s"] for f in runs["recompute"]]
    first = runs["recompute"][-1]
    row = {"images": n, "prompt_tokens": first["prompt_tokens"], "recompute_ttft_s": statistics.median(base),
           "ttft_s": {m: statistics.median(f["ttft_s"] for f in fs) for m, fs in runs.items()},
           "parts": {m: {p: statistics.median(f[p] for f in fs) for p in PARTS} for m, fs in runs.items()},
           "linked": runs["mpic"][-1]["status"]}
    if SERVER in runs:
        row["server_linked"] = runs[SERVER][-1]["status"]
    for m in list(runs)[1:]:
        row |= Spread.paired([f["ttft_s"] for f in runs[m]], base).fields(f"{m}_ratio")
        row[f"{m}_same_first_token"] = runs[m][-1]["first_token"] == first["first_token"]
    return row


COLUMNS = (("images", 6), ("tokens", 6), ("mode", 10), ("new kv", 6), ("ttft s", 8), ("/ recompute", 20),
           ("vision s", 8), ("linking s", 9), ("recompute s", 11), ("prefill s", 9), ("other s", 7))


def live(row: dict, first: bool) -> str:
    """One image count's lines (one per mode), under the header if ``first``."""
    lines = []
    if first:
        depth = (f"vision encoder {row['vision_layers']} blocks (cut by --vision-layers)" if row["vision_cut"]
                 else f"vision encoder at full depth ({row['vision_layers']} blocks)")
        lines += [f"model {row['model']}: decoder {row['layers']} layers, {depth}, {row['device']} {row['dtype']}, "
                  f"{row['threads']} thread(s); images' KV stored, question changed ahead of the images; "
                  f"MPIC-{row['k']}, CacheBlend-{row['ratio'] * 100:g}%; {row['repeats']} rounds, modes interleaved",
                  f"{SPREAD_NOTE}; parts in seconds (medians); new kv: prompt tokens whose KV this prompt "
                  "computed (mean over layers; the rest reused); * first token differs from full recompute's",
                  "  ".join(name.rjust(width) for name, width in COLUMNS)]
        if SERVER in row["modes"]:
            lines.insert(-1, f"{SERVER}: MPIC-{row['k']} on images stored on the server by another process, read by "
                             "a replica with an empty local tier (a new one per round)")
    for m in row["modes"]:
        part = row["parts"][m]
        ratio = "-" if m == "recompute" else (
            Spread(row[f"{m}_ratio"], *row[f"{m}_ratio_range"], row["repeats"]).cell()
            + ("" if row[f"{m}_same_first_token"] else "*"))
        lm = f"{part['lm_s']:.3f}"
        cells = [str(row["images"]), str(row["prompt_tokens"]), m, f"{part['new_kv_tokens']:.0f}",
                 f"{row['ttft_s'][m]:.3f}", ratio, f"{part['vision_s']:.3f}", f"{part['linking_s']:.3f}",
                 lm if m in LINKING else "-", "-" if m in LINKING else lm, f"{part['other_s']:.3f}"]
        lines.append("  ".join(c.rjust(width) for c, (_, width) in zip(cells, COLUMNS)))
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    return "\n".join(live(row, i == 0) for i, row in enumerate(rows))


def main(argv=None) -> int:
    return run_main(parse_args, run, table, argv, live=live)


if __name__ == "__main__":
    sys.exit(main())
