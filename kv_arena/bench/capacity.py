"""Room: how many visual tokens, frames of a video, pictures and conversations each method's cache
fits beside the model's weights in a card's memory.

    python -m kv_arena.bench --mode capacity --model random:Qwen/Qwen2-VL-2B-Instruct --memory-gb 24 \\
        --methods full,snapkv,kivi --budget 0.2 --json

At batch 1 a decode step reads the weights far more than the cache (``--mode decode``'s ``ideal``),
so a smaller cache buys little speed there; what it buys is room.

Measured, per method: the bytes its cache holds after a prefill (``KVCache.nbytes``: codes, scales
and full-precision residuals included, as the method stores them), in ``--dtype`` (bfloat16), on
the model's decoder at its real width, KV heads and head size with random weights (``--mode
prefill``'s decoder, no vision tower: the methods act in the decoder). Three prompts, each at
``--visual-tokens`` V (256) and 2V tokens between a 16-token system prefix and a 32-token question:

* a video of frames of 4 x 4 tokens (small frames, so a short run holds many: a method that keeps
  a video's first frame whole, EVS, pays that at both sizes),
* one picture of as many tokens,
* text alone, as long as the video prompt (its V or 2V tokens are text).

A token's bytes are the slope between the two sizes: what one more token costs once the method's
fixed part is paid (KIVI keeps up to 128 tokens a layer in full precision; keep V a multiple of 128
so it holds as many at both sizes). A method whose budget is a share of the prompt is near its
share only where the prompt is long next to its fixed parts: on a GPU give a larger V. One that
holds as much at 2V as at V (EVS at V = 128 and budget 0.2: the prompt's text and a first frame
already fill its budget) is shown as ``-`` (None), said under the table, never as room without end. A CPU runs
``--num-layers`` (2) of the decoder's layers and their bytes are scaled to the config's depth, which
is exact for a method that holds the same in every layer; one that spreads its budget over depth
(PyramidKV) is measured over the layers run (``--num-layers`` 0: every layer).

Computed: the weights' bytes (every parameter, the vision tower's included, counted on the meta
device, at ``--dtype``'s width or ``--quantization``'s 8 or 4 bits), the room (``--memory-gb``
GiB, as cards are labelled, less the weights and ``--reserve-gb``: :mod:`kv_arena.runtime.capacity`)
and what fits in it: ``tokens_fit`` visual tokens of a video, ``frames_fit`` frames at ``--frame``
(448x448; Qwen-VL: 256 tokens a temporal patch of 2 frames), ``pictures_fit`` pictures of
``--picture`` (1280x720: 1,196 tokens on Qwen2-VL), each at its prompt's bytes per token, and
``conversations_fit`` text conversations of ``--conversation-tokens`` (4,096), each its own cache
(the line through the two text sizes: a method's fixed part paid once per conversation);
``vs_full`` is ``tokens_fit`` over the full cache's.
``--memory-gb`` takes several sizes (24,80) or cards by name (T4, L4, A10G, L40S, ZeroGPU, RTX Pro
6000, A100: :data:`kv_arena.runtime.capacity.CARDS`). Exit code 2 and one line on stderr on bad input.

Beside ours, vLLM's figures for the same card (:func:`kv_arena.runtime.capacity.vllm_kv`): the tokens
its log would give as "GPU KV cache size: N tokens" (``vllm_kv_tokens``) and "Maximum concurrency for
L tokens per request: C x" (``vllm_concurrency``), for each method at its bytes per visual token; L is
``--max-model-len`` (the model's maximum length), the memory ``--gpu-memory-utilization`` (0.92) of the
card's, less the weights, an approximate profiled peak (``vllm_profiled_peak_bytes``) and the reserve.
``kv_peak_bytes_run``: the most the cache held during each run's prefill, on the layers run (a method
that compresses a layer after its attention holds that layer's whole prompt at the peak; one that
compresses after the pass, the whole prompt's: its gain is room while decoding).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from kv_arena import backends
from kv_arena.backends.layout import PromptLayout, VisualSpan

from ..errors import UserError
from ..runtime import capacity
from ..runtime.models import model_config, parameter_count, pick_device, pick_dtype
from .common import REFERENCE, aligned, run_main
from .decode import acts_before_decoder
from .methods import method_params
from .prefill import PREFIX, QUESTION, build_decoder, prefill, synthetic_prompt

KINDS = ("video", "image", "text")
FRAME_GRID = (4, 4)  # tokens of one frame group in the measured video (rows, columns)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-gb", required=True,
                   help="the card's memory in GiB, as labelled, or its name (A10G, L40S...); comma-separated for several")
    p.add_argument("--model", default="random:Qwen/Qwen2-VL-2B-Instruct", help="a random:<repo> or tiny model")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: every method in the decoder)")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--set", action="append", default=[], metavar="[METHOD.]NAME=VALUE", help="method parameter")
    p.add_argument("--visual-tokens", type=int, default=256, help="the short run: V and 2V tokens (default 256)")
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers run, scaled to the real depth (0: all)")
    p.add_argument("--frame", default="448x448", help="a video frame's size, WIDTHxHEIGHT (default 448x448)")
    p.add_argument("--picture", default="1280x720", help="a picture's size, WIDTHxHEIGHT (default 1280x720)")
    p.add_argument("--conversation-tokens", type=int, default=4096, help="tokens of one conversation (default 4096)")
    p.add_argument("--reserve-gb", type=float, default=capacity.RESERVE_GIB,
                   help=f"GiB kept beside weights and cache (default {capacity.RESERVE_GIB:g})")
    p.add_argument("--quantization", default=None, choices=sorted(capacity.QUANTIZED_BYTES), help="the weights' width")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16: cache and weights (default bfloat16)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="L of vLLM's concurrency figure (default: the model's maximum length)")
    p.add_argument("--gpu-memory-utilization", type=float, default=capacity.VLLM_UTILIZATION,
                   help=f"vLLM's share of the card (default {capacity.VLLM_UTILIZATION:g})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p.parse_args(argv)


def memory_sizes(text: str) -> list[float]:
    """GiB per ``--memory-gb`` entry: a number, or a card's name."""
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        named = capacity.card(part)
        try:
            sizes.append(named.memory_gib if named else float(part))
        except ValueError:
            cards = ", ".join(c.name for c in capacity.CARDS)
            raise UserError(f"--memory-gb expects GiB or a card ({cards}), comma-separated, got '{text}'") from None
    if not sizes or min(sizes) <= 0 or not all(math.isfinite(g) for g in sizes):
        raise UserError(f"--memory-gb must be positive and finite, got '{text}'")
    return sizes


def parameters(name: str) -> int:
    """Every parameter of the model (vision tower included), counted on the meta device."""
    try:
        return parameter_count(name)
    except ValueError:
        raise UserError(f"--mode capacity builds random weights: use random:<repo> or a tiny model, not '{name}'") from None


def prompt(kind: str, visual: int, rope_dims: int, hidden: int, device, dtype, seed: int):
    """Embeddings, rotary ids and layout of PREFIX text, ``visual`` tokens of ``kind`` (a video of
    FRAME_GRID frames, a picture, or text), QUESTION text."""
    if kind == "image":
        return synthetic_prompt(visual, rope_dims, hidden, device, dtype, seed)
    total = PREFIX + visual + QUESTION
    embeds = torch.randn(1, total, hidden, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    if kind == "text":
        rope = torch.arange(total).expand(rope_dims, -1)
        return embeds, rope.to(device), PromptLayout(0, total, system=(0, PREFIX), text=[(PREFIX, total)])
    h, w = FRAME_GRID
    t = visual // (h * w)
    frames = [(PREFIX + i * h * w, PREFIX + (i + 1) * h * w) for i in range(t)]
    index = torch.arange(t * h * w)
    if rope_dims == 3:  # M-RoPE: (frame, row, column) ids after the prefix, text after the largest
        after = PREFIX + max(t, h, w)
        grid = torch.stack([index // (h * w), index // w % h, index % w]) + PREFIX
        rope = torch.cat([torch.arange(PREFIX).expand(3, -1), grid, torch.arange(after, after + QUESTION).expand(3, -1)], 1)
    else:
        rope = torch.arange(total)[None]
    layout = PromptLayout(0, total, system=(0, PREFIX), text=[(PREFIX + visual, total)],
                          visuals=[VisualSpan("video", (PREFIX, PREFIX + visual), frames, (t, h, w))])
    return embeds, rope.to(device), layout


def checked(args: argparse.Namespace) -> list[str]:
    """The methods measured (the full cache first); every bad input fails here, before any work."""
    if not 0 < args.budget <= 1:
        raise UserError(f"--budget must lie in (0, 1]; got {args.budget}")
    group = FRAME_GRID[0] * FRAME_GRID[1]
    if args.visual_tokens < group or args.visual_tokens % group:
        raise UserError(f"--visual-tokens must be a positive multiple of {group} (the measured video's frames)")
    if args.conversation_tokens < 1 or args.num_layers < 0:
        raise UserError("--conversation-tokens must be positive and --num-layers at least 0")
    longest = context(args.model)
    if 2 * args.visual_tokens + PREFIX + QUESTION > longest:
        raise UserError(f"--visual-tokens {args.visual_tokens}: the longer run (2V + {PREFIX + QUESTION} tokens) must fit "
                        f"{args.model}'s context of {longest:,} tokens")
    if args.max_model_len is not None and not 0 < args.max_model_len <= longest:
        raise UserError(f"--max-model-len must lie in [1, {longest:,}] ({args.model}'s context)")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must lie in (0, 1]; got {args.gpu_memory_utilization}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else backends.available()
    for m in methods:
        backends.backend_class(m)  # unknown names fail before the model is built
    before = [m for m in methods if acts_before_decoder(m)]
    if args.methods and before:
        raise UserError(f"{', '.join(before)}: {'; '.join(acts_before_decoder(m) for m in before)}; this mode "
                        "measures the decoder's cache on synthetic embeddings, with no tower or media")
    methods = [REFERENCE] + [m for m in methods if m != REFERENCE and m not in before]
    return methods


def context(model: str) -> int:
    """The model's maximum length in tokens (its text config's ``max_position_embeddings``)."""
    try:
        return model_config(model).get_text_config().max_position_embeddings
    except ValueError:
        raise UserError(f"--mode capacity builds random weights: use random:<repo> or a tiny model, not '{model}'") from None


def measure(model, text, rope_dims: int, backend_of, sizes: list[int], device, dtype, seed: int) -> tuple[dict, dict]:
    """Kind -> [bytes held after the prompt at each size], and kind -> [the most held during that
    prefill], one fresh cache per prefill."""
    held, peak = {}, {}
    for kind in KINDS:
        held[kind], peak[kind] = [], []
        for visual in sizes:
            embeds, rope, layout = prompt(kind, visual, rope_dims, text.hidden_size, device, dtype, seed)
            _, _, cache = prefill(model, backend_of(), text.num_hidden_layers, embeds, rope, layout, sync=False)
            held[kind].append(cache.nbytes())
            peak[kind].append(max(cache.peak_bytes, cache.nbytes()))
    return held, peak


def weights_and_rooms(args: argparse.Namespace, dtype_bytes: int) -> tuple[int, dict[float, int]]:
    """The weights' bytes and, per ``--memory-gb``, the room beside them: a card too small fails
    here, before the model is built."""
    weights = capacity.weight_bytes(parameters(args.model), dtype_bytes, args.quantization)
    sizes = memory_sizes(args.memory_gb)
    try:
        return weights, {gb: capacity.room(gb * capacity.GIB, weights, args.reserve_gb * capacity.GIB)
                         for gb in sizes}
    except ValueError as exc:
        raise UserError(f"{args.model}: {exc}") from None


def bytes_per_token(args: argparse.Namespace, methods: list[str], params: dict, device, dtype) -> tuple[dict, dict]:
    """Method -> (kind -> bytes per token at the config's depth, a conversation's fixed bytes, the
    bytes held in each run), and what the run was: the depth, the layers run, the sizes."""
    depth = model_config(args.model).get_text_config().num_hidden_layers
    run_layers = min(args.num_layers or depth, depth)
    model, text, rope_dims = build_decoder(args.model, run_layers, device, dtype, args.seed)
    sizes = [args.visual_tokens, 2 * args.visual_tokens]
    scale = depth / run_layers  # the layers run stand for every layer
    found = {}
    for name in methods:
        held, peak = measure(model, text, rope_dims,
                             lambda n=name: backends.make_backend(n, budget=args.budget, **params[n]),
                             sizes, device, dtype, args.seed)
        # no growth from V to 2V: the run is shorter than the method's fixed part (EVS keeps a video's
        # first frame, and the prompt's text, whatever its budget), not a cache that holds nothing
        slope = {kind: (b[1] - b[0]) / args.visual_tokens * scale if b[1] > b[0] else None for kind, b in held.items()}
        # the text line's intercept: what a conversation holds besides its tokens (KIVI's residual)
        fixed = max(0.0, held["text"][0] * scale - (slope["text"] or 0) * (PREFIX + sizes[0] + QUESTION))
        found[name] = (slope, fixed, held, peak)
    return found, {"layers": depth, "layers_run": run_layers, "visual_tokens_run": sizes}


def run(args: argparse.Namespace) -> list[dict]:
    methods = checked(args)
    params = method_params(methods, args.set)
    built = {m: backends.make_backend(m, budget=args.budget, **params[m]) for m in methods}
    try:
        device = pick_device(args.device)
    except RuntimeError:
        raise UserError(f"--device: no device '{args.device}' (cpu, cuda, cuda:1...)") from None
    dtype_name, dtype = pick_dtype(args.dtype, device)
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    media = capacity.media_tokens(model_config(args.model), capacity.parse_size(args.picture, "--picture"),
                                  capacity.parse_size(args.frame, "--frame"))
    weights, rooms = weights_and_rooms(args, dtype_bytes)
    measured, shape = bytes_per_token(args, methods, params, device, dtype)
    real = model_config(args.model).get_text_config()
    head_dim = getattr(real, "head_dim", None) or real.hidden_size // real.num_attention_heads
    max_len = args.max_model_len or real.max_position_embeddings
    peak = capacity.profiled_peak(real, dtype_bytes)
    common = shape | {
        "model": args.model, "dtype": dtype_name, "budget": args.budget, "weight_bytes": weights,
        "weights": args.quantization or dtype_name, "reserve_bytes": int(args.reserve_gb * capacity.GIB),
        # the full cache by arithmetic (key and value, every layer and KV head), against which its measure is checked
        "full_bytes_per_token_config": 2 * shape["layers"] * real.num_key_value_heads * head_dim * dtype_bytes,
        "frame": args.frame, "tokens_per_frame": media.per_frame, "picture": args.picture,
        "tokens_per_picture": media.picture, "media_note": media.note, "conversation_tokens": args.conversation_tokens,
        "vllm_max_model_len": max_len, "vllm_gpu_memory_utilization": args.gpu_memory_utilization,
        "vllm_profiled_peak_bytes": peak, "vllm_block_tokens": capacity.VLLM_BLOCK}
    rows = []
    for gb, room in rooms.items():
        full_fit = capacity.fits(room, measured[REFERENCE][0]["video"])
        for name in methods:
            slope, fixed, held, peaks = measured[name]
            video, image, words = slope["video"], slope["image"], slope["text"]
            tokens_fit = fit(room, video)
            rows.append(common | {
                "memory_gb": gb, "room_bytes": room, "method": name, "uses_budget": built[name].uses_budget,
                "params": built[name].config,
                "bytes_per_visual_token": video, "bytes_per_picture_token": image, "bytes_per_text_token": words,
                "fixed_bytes_per_conversation": fixed,
                "tokens_fit": tokens_fit, "vs_full": None if tokens_fit is None else tokens_fit / full_fit,
                "frames_fit": _times(fit(room, video, media.frame_group), media.frames_per_group),
                "pictures_fit": fit(room, image, media.picture),
                "conversations_fit": fit(room, words, args.conversation_tokens, fixed),
                "kv_bytes_run": held, "kv_peak_bytes_run": peaks,
                # the most held during the longer video's prefill, over the full cache's (the layers run)
                "prefill_peak_vs_full": peaks["video"][1] / measured[REFERENCE][3]["video"][1],
                "too_short": [kind for kind, b in slope.items() if b is None]}
                | vllm_figures(args, gb, weights, peak, video, max_len))
    return rows


def vllm_figures(args, gb: float, weights: int, peak: int, per_token: float | None, max_len: int) -> dict:
    """vLLM's "GPU KV cache size" and "Maximum concurrency" for a cache of ``per_token`` bytes a token."""
    if per_token is None:
        return {"vllm_available_bytes": None, "vllm_kv_tokens": None, "vllm_concurrency": None}
    try:
        kv = capacity.vllm_kv(gb * capacity.GIB, weights, peak, args.reserve_gb * capacity.GIB, per_token, max_len,
                              args.gpu_memory_utilization)
    except ValueError as exc:
        raise UserError(f"{args.model} on {gb:g} GiB: {exc}") from None
    return {"vllm_available_bytes": kv.available_bytes, "vllm_kv_tokens": kv.tokens, "vllm_concurrency": kv.concurrency}


def fit(room: int, per_token: float | None, tokens: float = 1, fixed: float = 0.0) -> int | None:
    """Whole items of ``tokens`` tokens (and ``fixed`` bytes each) in ``room``; None: not measured."""
    return None if per_token is None else capacity.fits(room, fixed + per_token * tokens)


def _times(count: int | None, factor: int) -> int | None:
    return None if count is None else count * factor


def _size(n: float) -> str:
    return f"{n / capacity.GIB:.2f} GiB" if n >= capacity.GIB / 100 else f"{n / 2**20:.2f} MiB"


def _per_token(b: float | None) -> str:
    return "-" if b is None else f"{b:,.0f}"


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    gib = capacity.GIB
    lines = [f"{r0['model']}: {r0['layers']} layers, weights {_size(r0['weight_bytes'])} ({r0['weights']}), "
             f"cache in {r0['dtype']}, budget {r0['budget']}; bytes per token measured on {r0['layers_run']} layer(s) at "
             f"{r0['visual_tokens_run'][0]} and {r0['visual_tokens_run'][1]} tokens, scaled to {r0['layers']} "
             f"(the full cache by arithmetic: {r0['full_bytes_per_token_config']:,}); reserve "
             f"{r0['reserve_bytes'] / gib:g} GiB",
             f"frames of {r0['frame']} ({r0['tokens_per_frame']:g} tokens a frame), pictures of {r0['picture']} "
             f"({r0['tokens_per_picture']:,} tokens{', ' + r0['media_note'] if r0['media_note'] else ''}), "
             f"conversations of {r0['conversation_tokens']:,} text tokens"]
    lines.append(f"vLLM (gpu_memory_utilization {r0['vllm_gpu_memory_utilization']:g}, blocks of "
                 f"{r0['vllm_block_tokens']}, a profiled peak of about {_size(r0['vllm_profiled_peak_bytes'])}): "
                 f"\"GPU KV cache size: N tokens\", \"Maximum concurrency for {r0['vllm_max_model_len']:,} tokens per "
                 f"request: C x\"")
    cells = [["GiB", "method", "B/visual", "B/text", "visual tokens", "x full", "frames", "pictures", "conversations",
              "vLLM N", "vLLM C", "peak"]]
    for r in rows:
        cells.append([f"{r['memory_gb']:g}", r["method"], _per_token(r["bytes_per_visual_token"]),
                      _per_token(r["bytes_per_text_token"]), _count(r["tokens_fit"]),
                      "-" if r["vs_full"] is None else f"{r['vs_full']:.2f}", _count(r["frames_fit"]),
                      _count(r["pictures_fit"]), _count(r["conversations_fit"]), _count(r["vllm_kv_tokens"]),
                      "-" if r["vllm_concurrency"] is None else f"{r['vllm_concurrency']:.2f}x",
                      f"{r['prefill_peak_vs_full']:.2f}"])
    short = {r["method"]: r["too_short"] for r in rows if r["too_short"]}
    notes = [f"-: {m} held as much at {r0['visual_tokens_run'][1]} tokens as at {r0['visual_tokens_run'][0]} "
             f"({', '.join(kinds)}): the run is shorter than its fixed part; give a larger --visual-tokens"
             for m, kinds in short.items()]
    notes.append(f"peak: the most the cache held during the {r0['visual_tokens_run'][1]}-token video's prefill over "
                 f"the full cache's, on the {r0['layers_run']} layer(s) run (a method that compresses after the whole "
                 "pass holds the whole prompt's KV there: its gain is room while decoding)")
    return "\n".join(lines + aligned(cells) + notes)


def main(argv=None) -> int:
    return run_main(parse_args, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
