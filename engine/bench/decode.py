"""Method overheads and decode-step cost against the full cache, and the runtime's own attention
against transformers' stock ``sdpa``: same weights, same inputs, one run.

    python -m engine.bench --mode decode --model random:Qwen/Qwen2-VL-2B-Instruct --num-layers 4 \\
        --visual-tokens 4096,8192 --budget 0.2 --repeats 3 --json

What runs: the decoder alone at its real width with random weights, fed random visual embeddings
between a short prefix and a question (``engine.bench.prefill``'s synthetic prompt), then
``--steps`` decode steps of one random embedding each. Per repeat, every method (and stock
``sdpa`` without our seam) prefills and decodes once, in an order rotated per repeat so drift on a
shared machine hits every method alike; the figures are medians over repeats (a repeat's step
time is the median of its steps).

Printed per method: ``kv_ratio`` (bytes held after prefill / full's), ``scoring_ratio`` (time in the
method's hooks during prefill / full's prefill; a method whose scores the prefill attention sums in
its own pass, ``needs_prefill_column_sums``, pays inside the prefill: its ``prefill_ratio`` - 1), ``prefill_ratio`` and ``decode_ratio`` (step time /
full's), and ``ideal`` = (W + KV_kept) / (W + KV_full): a batch-1 decode step reads the weights W
and the cache, so that is the best a smaller cache can do. The ``sdpa`` row compares the full cache
through the runtime with stock attention (its ratios are runtime / stock). Exit code 2 on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache

import backends
from backends.base import AttentionCall

from ..errors import UserError
from ..runtime.attention import ATTENTION_NAME, ForwardRun, forward_run
from ..runtime.cache import KVCache
from ..runtime.models import pick_device, pick_dtype
from .common import add_run_args, run_main, visual_sizes
from .methods import method_params
from .prefill import build_decoder, synthetic_prompt

STOCK = "sdpa"  # transformers' own attention on the same weights, no seam
WARMUP_VISUAL = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench --mode decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:Qwen/Qwen2-VL-2B-Instruct", help="a random:<repo> or tiny model")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: every method)")
    p.add_argument("--visual-tokens", default="4096,8192", help="comma-separated sizes")
    p.add_argument("--num-layers", type=int, default=None, help="decoder depth (e.g. 2 or 4 on a CPU)")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--set", action="append", default=[], metavar="[METHOD.]NAME=VALUE", help="method parameter")
    p.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    add_run_args(p)
    return p.parse_args(argv)


class Clock:
    """Wall time that waits for the device where it runs asynchronously."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class Session:
    """One prefill and ``steps`` decode steps of one method (or stock sdpa) on the shared decoder."""

    def __init__(self, model, text, rope_dims: int, clock: Clock) -> None:
        self.model, self.text, self.rope_dims, self.clock = model, text, rope_dims, clock
        self.dummy = torch.zeros(1, dtype=model.dtype, device=model.device)

    def position_ids(self, rope: torch.Tensor) -> torch.Tensor:
        return rope[:, None, :] if self.rope_dims == 3 else rope

    def rotary(self, rope: torch.Tensor):
        return self.model.rotary_emb(self.dummy, self.position_ids(rope.to(self.model.device)))

    def run(self, method: str, budget: float, params: dict, embeds, rope, layout, steps: int) -> dict:
        stock = method == STOCK
        self.text._attn_implementation = "sdpa" if stock else ATTENTION_NAME
        backend = None if stock else make_backend(method, budget, params)
        cache = DynamicCache(config=self.text) if stock else KVCache(backend, self.text.num_hidden_layers)
        total = embeds.shape[1]
        prefill_s, overhead = self.forward(backend, cache, embeds, rope, layout, torch.arange(total), total, 0)
        kv_bytes = _cache_bytes(cache)
        generator = torch.Generator().manual_seed(1)
        next_rope, step_s = int(rope.max()) + 1, []
        for step in range(1, steps + 1):
            token = torch.randn(1, 1, embeds.shape[2], generator=generator).to(embeds.device, embeds.dtype)
            ids = torch.full((rope.shape[0], 1), next_rope + step - 1, device=rope.device)
            seconds, _ = self.forward(backend, cache, token, ids, None, torch.tensor([total + step - 1]),
                                      total + step, step)
            step_s.append(seconds)
        self.text._attn_implementation = ATTENTION_NAME
        return {"prefill_s": prefill_s, "overhead_s": overhead, "step_s": statistics.median(step_s), "kv_bytes": kv_bytes}

    def forward(self, backend, cache, embeds, rope, layout, positions, seen: int, step: int) -> tuple[float, float]:
        """One timed forward pass: (seconds, seconds inside the method's hooks)."""
        position_ids = self.position_ids(rope)
        if backend is None:
            start = self.clock()
            with torch.inference_mode():
                self.model(inputs_embeds=embeds, position_ids=position_ids, past_key_values=cache, use_cache=True)
            return self.clock() - start, 0.0
        positions = positions.to(embeds.device)
        cache.pending_positions = positions
        call = AttentionCall(layer_idx=0, num_layers=self.text.num_hidden_layers,
                             phase="prefill" if embeds.shape[1] > 1 else "decode", positions=positions,
                             rope_ids=rope, layout=layout, seen=seen, step=step, rotary=self.rotary)
        run = ForwardRun(cache, call, sync=self.clock.cuda)
        start = self.clock()
        with torch.inference_mode(), forward_run(run):
            self.model(inputs_embeds=embeds, position_ids=position_ids, past_key_values=cache, use_cache=True)
            run.timed(backend.after_forward, cache, call)
        return self.clock() - start, run.settle()


def make_backend(name: str, budget: float, params: dict):
    """The method at ``budget``; one with its own knob instead (ZipVL's tau) runs at that knob."""
    if not backends.backend_class(name).uses_budget:
        return backends.make_backend(name, **params)
    return backends.make_backend(name, budget=budget, **params)


def _cache_bytes(cache) -> int:
    if isinstance(cache, KVCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def run(args: argparse.Namespace) -> list[dict]:
    if args.repeats < 1 or args.steps < 1:
        raise UserError("--repeats and --steps must be at least 1")
    methods = args.methods.split(",") if args.methods else backends.available()
    for m in methods:
        backends.backend_class(m)  # unknown names fail before the model is built
    methods = ["full"] + [m for m in methods if m != "full"]
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

    def measure(name: str, visual: int, steps: int) -> dict:
        embeds, rope, layout = synthetic_prompt(visual, rope_dims, text.hidden_size, device, dtype, args.seed)
        return session.run(name, args.budget, params.get(name, {}), embeds, rope, layout, steps)

    for name in names:  # warm-up on a short prompt
        measure(name, WARMUP_VISUAL, 2)
    rows = []
    for visual in sizes:
        runs = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                runs[name].append(measure(name, visual, args.steps))
        med = {name: {k: statistics.median(x[k] for x in runs[name]) for k in runs[name][0]} for name in names}
        full = med["full"]
        common = {"model": args.model, "layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
                  "device": str(device), "dtype": dtype_name, "threads": torch.get_num_threads(),
                  "visual_tokens": visual, "budget": args.budget, "repeats": args.repeats, "steps": args.steps,
                  "weight_bytes": weight_bytes}
        for name in names:
            m = med[name]
            ref = med["sdpa"] if name == "full" else full
            rows.append(common | {
                "method": name, "prefill_s": m["prefill_s"], "overhead_s": m["overhead_s"], "step_s": m["step_s"],
                "kv_bytes": m["kv_bytes"], "kv_ratio": m["kv_bytes"] / full["kv_bytes"],
                "scoring_ratio": m["overhead_s"] / full["prefill_s"],
                "prefill_ratio": m["prefill_s"] / full["prefill_s"], "decode_ratio": m["step_s"] / full["step_s"],
                "ideal": (weight_bytes + m["kv_bytes"]) / (weight_bytes + full["kv_bytes"]),
                "params": params.get(name, {}),
            })
            if name == "full":  # the seam: runtime's full cache / stock sdpa
                rows[-1] |= {"vs_sdpa_prefill": m["prefill_s"] / ref["prefill_s"], "vs_sdpa_decode": m["step_s"] / ref["step_s"]}
    return rows


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    lines = [f"{r0['model']}, {r0['layers']} layers x {r0['hidden_size']}, {r0['device']} {r0['dtype']}, "
             f"{r0['threads']} thread(s), budget {r0['budget']}, median of {r0['repeats']} interleaved repeats, "
             f"{r0['steps']} decode steps each; ratios against the full cache through the runtime"]
    head = (f"{'visual':>7} {'method':>15} {'kv':>6} {'scoring':>8} {'prefill':>8} {'decode':>7} {'ideal':>6} "
            f"{'full_prefill_s':>14} {'full_step_ms':>12}")
    for visual in dict.fromkeys(r["visual_tokens"] for r in rows):
        group = [r for r in rows if r["visual_tokens"] == visual]
        full = next(r for r in group if r["method"] == "full")
        lines.append(head)
        for r in group:
            if r["method"] == STOCK:
                continue
            lines.append(f"{visual:>7} {r['method']:>15} {r['kv_ratio']:>6.3f} {r['scoring_ratio']:>8.3f} "
                         f"{r['prefill_ratio']:>8.2f} {r['decode_ratio']:>7.2f} {r['ideal']:>6.3f} "
                         f"{full['prefill_s']:>14.2f} {full['step_s'] * 1000:>12.1f}")
        lines.append(f"{visual:>7} full (runtime) / stock sdpa: prefill {full['vs_sdpa_prefill']:.3f}, "
                     f"decode step {full['vs_sdpa_decode']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run_main(parse_args, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
