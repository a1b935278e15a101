"""Method overheads and decode-step cost against the full cache, and the runtime's own attention
against transformers' stock ``sdpa``: same weights, same inputs, one run.

    python -m kv_arena.bench --mode decode --model random:Qwen/Qwen2-VL-2B-Instruct --num-layers 4 \\
        --visual-tokens 4096,8192 --budget 0.2 --repeats 3 --json

What runs: the decoder alone at its real width with random weights, fed random visual embeddings
between a short prefix and a question (``kv_arena.bench.prefill``'s synthetic prompt), then
``--steps`` decode steps of one random embedding each. Per repeat, every method (and stock
``sdpa`` without our seam) prefills once, in an order rotated per repeat; then the methods take
their decode steps in turns (step 1 of each, step 2 of each...), so drift on a shared machine hits
every method's steps alike. Times are medians over repeats (a repeat's step time is the median of
its steps); each timed ratio is taken per repeat against the full cache of the same repeat and
printed as its median with the min-max over repeats, marked where that range crosses 1.

Printed per method: ``kv_ratio`` (bytes held after prefill / full's), ``scoring_ratio`` (time in the
method's hooks during prefill / full's prefill; a method whose scores the prefill attention sums in
its own pass, ``needs_prefill_column_sums``, pays inside the prefill: its ``prefill_ratio`` - 1), ``prefill_ratio`` and ``decode_ratio`` (step time /
full's), and ``ideal`` = (W + KV_kept) / (W + KV_full): a batch-1 decode step reads the weights W
and the cache, so that is the best a smaller cache can do. On CUDA, times are read from CUDA events and
``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated`` over one method's prefill and step run alone
(None on a CPU), against ``memory_bound_bytes``, the weights plus the KV it holds. The ``sdpa`` row compares the full cache
through the runtime with stock attention (its ratios are runtime / stock). A method that picks an
image's tokens before the decoder (VisionZip), or that shrinks the media before the tower (Downsample), has
no tower or media to act on here: named, it is refused; with every method, left out. Exit code 2 on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kv_arena import backends
from kv_arena.backends.base import AttentionCall

from ..errors import UserError
from ..runtime.attention import ATTENTION_NAME
from ..runtime.cache import KVCache
from ..runtime.forward import cache_keyword, position_ids, run_forward
from ..runtime.models import pick_device, pick_dtype
from .common import (
    REFERENCE,
    SPREAD_NOTE,
    Spread,
    add_repeats_arg,
    add_run_args,
    aligned,
    check_repeats,
    rotated,
    run_main,
    visual_sizes,
)
from .methods import method_params
from .prefill import build_decoder, synthetic_prompt

STOCK = "sdpa"  # transformers' own attention on the same weights, no seam
WARMUP_VISUAL = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:Qwen/Qwen2-VL-2B-Instruct", help="a random:<repo> or tiny model")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: every method)")
    p.add_argument("--visual-tokens", default="4096,8192", help="comma-separated sizes")
    p.add_argument("--num-layers", type=int, default=None, help="decoder depth (e.g. 2 or 4 on a CPU)")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--set", action="append", default=[], metavar="[METHOD.]NAME=VALUE", help="method parameter")
    p.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    add_repeats_arg(p)
    add_run_args(p)
    return p.parse_args(argv)


class Clock:
    """Seconds: on CUDA the device's own clock (an event recorded and waited for, read against one
    recorded at the start: kernels queued, not Python, are timed), elsewhere ``perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()

    def __call__(self) -> float:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        return self.origin.elapsed_time(event) / 1000  # milliseconds between the events


def peak_memory(device: torch.device, work) -> int | None:
    """``torch.cuda.max_memory_allocated`` over ``work()`` alone; None off CUDA (no allocator to ask)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    work()
    return torch.cuda.max_memory_allocated(device)


class Session:
    """One prefill and ``steps`` decode steps of one method (or stock sdpa) on the shared decoder."""

    def __init__(self, model, text, rope_dims: int, clock: Clock) -> None:
        self.model, self.text, self.rope_dims, self.clock = model, text, rope_dims, clock
        self.dummy = torch.zeros(1, dtype=model.dtype, device=model.device)

    def rotary(self, rope: torch.Tensor):
        return self.model.rotary_emb(self.dummy, position_ids(rope.to(self.model.device)))

    def prefill(self, method: str, budget: float, params: dict, embeds, rope, layout) -> "Decoding":
        """One timed prefill of ``method`` (or stock sdpa); the returned state takes the decode steps."""
        backend = None if method == STOCK else make_backend(method, budget, params)
        cache = DynamicCache(config=self.text) if backend is None else KVCache(backend, self.text.num_hidden_layers)
        total = embeds.shape[1]
        seconds, overhead = self.forward(backend, cache, embeds, rope, layout, torch.arange(total), total, 0)
        return Decoding(backend, cache, total, int(rope.max()) + 1, seconds, overhead, _cache_bytes(cache))

    def step(self, state: "Decoding", token: torch.Tensor) -> None:
        """One timed decode step of ``token`` (1, 1, hidden) on ``state``'s cache."""
        state.steps += 1
        ids = torch.full((self.rope_dims, 1), state.next_rope + state.steps - 1, device=token.device)
        position = torch.tensor([state.total + state.steps - 1])
        seconds, _ = self.forward(state.backend, state.cache, token, ids, None, position,
                                  state.total + state.steps, state.steps)
        state.step_s.append(seconds)

    def forward(self, backend, cache, embeds, rope, layout, positions, seen: int, step: int) -> tuple[float, float]:
        """One timed forward pass: (seconds, seconds inside the method's hooks)."""
        self.model.set_attn_implementation(STOCK if backend is None else ATTENTION_NAME)
        if backend is None:
            start = self.clock()
            with torch.inference_mode():
                self.model(inputs_embeds=embeds, position_ids=position_ids(rope), use_cache=True,
                           **{cache_keyword(self.model): cache})
            return self.clock() - start, 0.0
        call = AttentionCall(layer_idx=0, num_layers=self.text.num_hidden_layers,
                             phase="prefill" if embeds.shape[1] > 1 else "decode", positions=positions.to(embeds.device),
                             rope_ids=rope, layout=layout, seen=seen, step=step, rotary=self.rotary)
        start = self.clock()
        with torch.inference_mode():
            _, run = run_forward(self.model, cache, call, sync=self.clock.cuda, inputs_embeds=embeds)
        return self.clock() - start, run.settle()


@dataclass
class Decoding:
    """A prefilled cache and what was measured on it so far."""

    backend: object  # None: stock sdpa
    cache: object
    total: int  # prompt tokens
    next_rope: int  # rotary id of the first generated token
    prefill_s: float
    overhead_s: float
    kv_bytes: int  # held after the prefill
    steps: int = 0
    step_s: list = field(default_factory=list)

    def figures(self) -> dict:
        return {"prefill_s": self.prefill_s, "overhead_s": self.overhead_s, "kv_bytes": self.kv_bytes,
                "step_s": statistics.median(self.step_s)}


def make_backend(name: str, budget: float, params: dict):
    """The method at ``budget`` (one with its own knob instead, ZipVL's tau, runs at that knob)."""
    return backends.make_backend(name, budget=budget, **params)


def acts_before_decoder(name: str) -> str | None:
    """What a method does before the decoder (None: nothing), for which the decoder-only benches have
    no input: it picks an image's tokens in the vision tower (VisionZip), or it shrinks the media
    before the tower (Downsample; a synthetic prompt has no media to shrink, so it would be the full cache)."""
    if backends.make_backend(name).selects_visual_tokens:
        return "picks tokens before the decoder"
    if backends.backend_class(name).resizes_media:
        return "resizes the media before the vision tower"
    return None


def _cache_bytes(cache) -> int:
    if isinstance(cache, KVCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def run(args: argparse.Namespace) -> list[dict]:
    check_repeats(args.repeats)
    if args.steps < 1:
        raise UserError("--steps must be at least 1")
    methods = args.methods.split(",") if args.methods else backends.available()
    for m in methods:
        backends.backend_class(m)  # unknown names fail before the model is built
    before_decoder = [m for m in methods if acts_before_decoder(m)]
    if args.methods and before_decoder:
        raise UserError(f"{', '.join(before_decoder)}: {'; '.join(acts_before_decoder(m) for m in before_decoder)}; "
                        "this mode feeds the decoder synthetic embeddings, with no tower: time it with --mode methods "
                        "on a model it runs on")
    methods = [m for m in methods if m not in before_decoder]  # all methods: left out, as said above
    methods = [REFERENCE] + [m for m in methods if m != REFERENCE]
    params = method_params(methods, args.set)
    for m in methods:
        make_backend(m, args.budget, params[m])
    device = pick_device(args.device)
    clock = Clock(device)
    dtype_name, dtype = pick_dtype(args.dtype, device)
    sizes = visual_sizes(args.visual_tokens)
    model, text, rope_dims = build_decoder(args.model, args.num_layers, device, dtype, args.seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    session = Session(model, text, rope_dims, clock)
    names = methods + [STOCK]

    def measure(visual: int, order: list[str], steps: int) -> dict[str, dict]:
        """Each method's prefill in ``order``, then ``steps`` decode steps taken in turns."""
        embeds, rope, layout = synthetic_prompt(visual, rope_dims, text.hidden_size, device, dtype, args.seed)
        states = {name: session.prefill(name, args.budget, params.get(name, {}), embeds, rope, layout)
                  for name in order}
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            token = torch.randn(1, 1, embeds.shape[2], generator=generator).to(device, dtype)
            for name in order:
                session.step(states[name], token)
        return {name: state.figures() for name, state in states.items()}

    for name in names:  # warm-up on a short prompt, one method at a time
        measure(WARMUP_VISUAL, [name], 2)
    rows = []
    for visual in sizes:
        runs = {name: [] for name in names}
        for r in range(args.repeats):
            for name, figures in measure(visual, rotated(names, r), args.steps).items():
                runs[name].append(figures)
        med = {name: {k: statistics.median(x[k] for x in runs[name]) for k in runs[name][0]} for name in names}
        # each method alone (the timed repeats hold every method's cache at once): one prefill and a step
        peaks = {name: peak_memory(device, lambda n=name: measure(visual, [n], 1)) for name in names}

        def ratio(name: str, key: str, ref: str = REFERENCE, by: str | None = None) -> Spread:
            """``key`` of ``name`` / ``by`` (default: ``key``) of ``ref``, per repeat."""
            return Spread.paired([x[key] for x in runs[name]], [x[by or key] for x in runs[ref]])

        full = med[REFERENCE]
        common = {"model": args.model, "layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
                  "device": str(device), "dtype": dtype_name, "threads": torch.get_num_threads(),
                  "visual_tokens": visual, "budget": args.budget, "repeats": args.repeats, "steps": args.steps,
                  "weight_bytes": weight_bytes}
        for name in names:
            m = med[name]
            rows.append(common | {
                "method": name, "prefill_s": m["prefill_s"], "overhead_s": m["overhead_s"], "step_s": m["step_s"],
                "kv_bytes": m["kv_bytes"], "kv_ratio": m["kv_bytes"] / full["kv_bytes"],
                **ratio(name, "overhead_s", by="prefill_s").fields("scoring_ratio"),
                **ratio(name, "prefill_s").fields("prefill_ratio"), **ratio(name, "step_s").fields("decode_ratio"),
                "ideal": (weight_bytes + m["kv_bytes"]) / (weight_bytes + full["kv_bytes"]),
                "peak_memory_bytes": peaks[name], "memory_bound_bytes": weight_bytes + m["kv_bytes"],
                "params": params.get(name, {}),
            })
            if name == REFERENCE:  # the seam: runtime's full cache / stock sdpa
                rows[-1] |= {**ratio(name, "prefill_s", STOCK).fields("vs_sdpa_prefill"),
                             **ratio(name, "step_s", STOCK).fields("vs_sdpa_decode")}
    return rows


def _spread(row: dict, name: str) -> Spread:
    return Spread(row[name], *row[f"{name}_range"], row["repeats"])


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    lines = [f"{r0['model']}, {r0['layers']} layers x {r0['hidden_size']}, {r0['device']} {r0['dtype']}, "
             f"{r0['threads']} thread(s), budget {r0['budget']}, {r0['repeats']} repeats, "
             f"{r0['steps']} decode steps each taken in turns; ratios against the full cache through the runtime",
             SPREAD_NOTE]
    for visual in dict.fromkeys(r["visual_tokens"] for r in rows):
        group = [r for r in rows if r["visual_tokens"] == visual]
        full = next(r for r in group if r["method"] == REFERENCE)
        cells = [["visual", "method", "kv", "scoring", "prefill", "decode", "ideal", "full_prefill_s", "full_step_ms"]]
        for r in group:
            if r["method"] == STOCK:
                continue
            cells.append([str(visual), r["method"], f"{r['kv_ratio']:.3f}", _spread(r, "scoring_ratio").cell(3),
                          _spread(r, "prefill_ratio").cell(), _spread(r, "decode_ratio").cell(), f"{r['ideal']:.3f}",
                          f"{full['prefill_s']:.2f}", f"{full['step_s'] * 1000:.1f}"])
        lines += aligned(cells)
        lines.append(f"{visual:>7} full (runtime) / stock sdpa: prefill {_spread(full, 'vs_sdpa_prefill').cell(3)}, "
                     f"decode step {_spread(full, 'vs_sdpa_decode').cell(3)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run_main(parse_args, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
