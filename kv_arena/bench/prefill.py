"""The methods whose prefill itself runs on fewer tokens against the full cache: ZipVL's token-sparse
attention and FastV's layers after K on the kept rows. Language-model prefill time at growing
numbers of visual tokens, every method in one run, same weights, same inputs.

    python -m kv_arena.bench --mode prefill --model random:Qwen/Qwen2-VL-2B-Instruct --num-layers 2 \\
        --visual-tokens 2048,8192 --repeats 3 --json
    python -m kv_arena.bench --mode prefill --methods fastv --num-layers 8 --visual-tokens 4096

FastV (``--methods fastv``, K and R from ``--set fastv.k_layer=...``): its rows are the first K
layers at every token and the later ones at the text plus the kept visual tokens; ``ideal`` is that
share of the full prefill's rows (1 / ideal is the speed-up if a layer cost what its rows do: at
K = 2, R = 50% on 8 layers and 4,096 visual tokens, 0.63, i.e. 1.6x). Its scoring (the last token's
attention row in layer K) runs inside the clock.

What is timed: one prefill forward pass of the decoder (every layer at its real width, the
attention through the runtime's seam, so ZipVL's probes, split, sparse attention and quantisation
are all inside the clock). What is not: the vision tower. Thousands of real patches through it
would dominate (and on a CPU take minutes), and it is identical for both methods, so the decoder
is fed precomputed random visual embeddings (N(0, 1)) between a short system prefix and a
question, with the positions the model gives an image of that many tokens: M-RoPE
(temporal, row, column) ids for Qwen-VL, 1-D positions otherwise. The vocabulary is cut to 256
rows because no token is embedded. Random weights are enough: the cost of a prefill does not
depend on them, but their near-uniform attention makes the important ratio high: about 0.93 at the
paper's tau 0.975, where the paper's trained models keep 42-53% (Tables 1 and 3). ``--tau`` (old
name ``--budget``: ZipVL takes no budget) takes several values, so a sweep (e.g. 0.975,0.8,0.5)
prints the time against the realised important ratio: where sparse prefill starts to pay for a
model whose attention is that sparse.

Warm-up: one pass per method; then ``--repeats`` rounds of one pass each, in an order rotated per
round. Printed per size and method (ZipVL: per tau): both times (medians), their ratio (method / full of the same round:
< 1 means sparse prefill pays; the median with the min-max over rounds, marked where it crosses 1),
its inverse (``speedup``, full / method, with its range),
the realised important ratio (mean over layers), ZipVL's KV bytes against the full cache's, and:

* ``attn``: attention's share of the full prefill, measured in the same passes (the full cache's
  attention runs inside a clock: the same kernel, so the same work).
* ``ideal`` = 1 - attn x (1 - mean over layers of r^2), r the layer's important ratio: the prefill
  ZipVL would take if attending among the important tokens only (r^2 of the causal attention's
  query-key pairs) cost nothing more, its probes and split included. The rest of a layer (the
  projections, the MLP) still runs for every token, so this is what token-sparse attention can
  save of this prefill, as the decode benchmark's ``ideal`` is what a smaller cache can save of a step.

Default sizes: 2k and 8k visual tokens, plus 32k on CUDA. Exit code 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from kv_arena import backends
from kv_arena.backends.attention_math import causal_attention
from kv_arena.backends.base import AttentionCall
from kv_arena.backends.full import FullCache
from kv_arena.backends.layout import PromptLayout, VisualSpan

from ..errors import UserError
from ..runtime.attention import ATTENTION_NAME, active_run
from ..runtime.cache import KVCache
from ..runtime.forward import rotary_of, run_forward
from ..runtime.models import (
    model_spec,
    pick_device,
    pick_dtype,
    random_model,
    shipped_config,
)
from ..tiny.builtin import tiny_config
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

PREFIX, QUESTION = 16, 32  # text tokens before and after the image (system prompt, question)
SPARSE_PREFILL = tuple(backends.names_where(lambda cls: cls.shortens_prefill))  # prefill on fewer tokens


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:Qwen/Qwen2-VL-2B-Instruct", help="a random:<repo> or tiny model")
    p.add_argument("--visual-tokens", default=None, help="comma-separated sizes (default 2048,8192; +32768 on CUDA)")
    p.add_argument("--num-layers", type=int, default=None, help="decoder depth (e.g. 2 for short CPU runs)")
    p.add_argument("--tau", "--budget", dest="budget", default="0.975",
                   help="ZipVL's tau, comma-separated for a sweep (paper: 0.975); --budget is the old name")
    p.add_argument("--methods", default="zipvl", help="comma-separated: zipvl (its token-sparse attention), fastv "
                   "(its layers after K on the kept rows), or both")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a method's parameter, e.g. fastv.k_layer=3 (repeatable)")
    add_repeats_arg(p)
    add_run_args(p)
    return p.parse_args(argv)


class AttentionTimedFull(FullCache):
    """The full cache whose prefill attention (the runtime's own kernel) runs inside the forward
    pass's hook clock, so the pass reports its attention seconds as its overhead."""

    def attend(self, call, query, key, value, scaling: float):
        if not call.is_prefill:
            return None
        return active_run().timed(causal_attention, query, key, value, scaling)


def build_decoder(name: str, num_layers: int | None, device: torch.device, dtype: torch.dtype, seed: int):
    """The language model alone (no vision tower, no LM head), random weights, our attention."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    spec = model_spec(name)
    if spec.source == "hub":
        raise UserError(f"--mode prefill builds random weights: use random:<repo> or a tiny model, not '{name}'")
    config = shipped_config(spec.repo, num_layers) if spec.source == "random" else tiny_config(spec.family)
    text = config.get_text_config()
    if num_layers and spec.source != "random":
        text.num_hidden_layers = num_layers
    text.vocab_size = 256  # inputs arrive as embeddings
    text.pad_token_id = None  # a padding id past the cut vocabulary (tiny LLaVA's 260) embeds nothing here
    model = random_model(MODEL_MAPPING[type(text)], text, device, dtype, seed).eval()
    model.set_attn_implementation(ATTENTION_NAME)
    rope_dims = 3 if "mrope_section" in (getattr(text, "rope_parameters", None) or {}) else 1
    return model, text, rope_dims


def synthetic_prompt(visual: int, rope_dims: int, hidden: int, device, dtype, seed: int):
    """Embeddings, rotary ids (P, T) and layout of: PREFIX text, one image of ``visual`` tokens
    (an h x w grid as square as divides it), QUESTION text."""
    w = max(d for d in range(1, math.isqrt(visual) + 1) if visual % d == 0)
    h = visual // w
    total = PREFIX + visual + QUESTION
    if rope_dims == 3:  # M-RoPE: text advances all three ids; the image uses (t, row, column)
        grid = torch.stack([torch.zeros(visual, dtype=torch.long), torch.arange(visual) // w, torch.arange(visual) % w])
        after = PREFIX + max(h, w)
        rope = torch.cat([torch.arange(PREFIX).expand(3, -1), grid + PREFIX,
                          torch.arange(after, after + QUESTION).expand(3, -1)], dim=1)
    else:
        rope = torch.arange(total)[None]
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, total, hidden, generator=generator).to(device, dtype)
    layout = PromptLayout(0, total, system=(0, PREFIX), visuals=[VisualSpan("image", (PREFIX, PREFIX + visual), grid=(1, h, w))],
                          text=[(PREFIX + visual, total)])
    return embeds, rope.to(device), layout


def prefill(model, backend, num_layers: int, embeds, rope, layout, sync: bool) -> tuple[float, float, KVCache]:
    """One timed prefill through the runtime's attention seam: (seconds, seconds in the backend's
    timed hooks, cache)."""
    total = embeds.shape[1]
    cache = KVCache(backend, num_layers)
    call = AttentionCall(layer_idx=0, num_layers=num_layers, phase="prefill",
                         positions=torch.arange(total, device=embeds.device), rope_ids=rope, layout=layout,
                         seen=total, step=0, rotary=rotary_of(model))
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        _, run = run_forward(model, cache, call, sync=sync, inputs_embeds=embeds)
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start, run.settle(), cache


def variants(args: argparse.Namespace) -> dict:
    """Label -> (method, parameters) of every prefill compared with the full cache: ZipVL once per
    ``--tau``, FastV once; bad names and parameters fail here, before the model is built."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in SPARSE_PREFILL]
    if unknown or not methods:
        raise UserError(f"--methods takes {', '.join(SPARSE_PREFILL)} (the methods whose prefill runs on fewer "
                        f"tokens), got '{args.methods}'")
    try:
        taus = [float(t) for t in str(args.budget).split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--tau expects comma-separated values, got '{args.budget}'") from None
    if not taus and any(map(sweeps_tau, methods)):
        raise UserError("--tau needs at least one value")
    params = method_params(methods, args.set)
    found = {}
    for method in methods:
        for value in (taus if sweeps_tau(method) else [None]):
            chosen = params[method] | ({} if value is None else {"tau": value})
            backends.make_backend(method, **chosen)
            found[method if value is None else value] = (method, chosen)
    return found


def sweeps_tau(method: str) -> bool:
    """Whether the method's knob is a ``tau`` (ZipVL's attention mass), swept by ``--tau``."""
    return any(p.name == "tau" for p in backends.backend_class(method).param_specs())


def fastv_rows_share(cache: KVCache, layers: int) -> float:
    """FastV's prefill rows over the full cache's, all layers: the share of the token-layer work left
    (the first K layers run every row, the later ones the kept rows: what each layer's cache got)."""
    return sum(cache.tokens_per_layer()) / (layers * cache.tokens_per_layer()[0])


def run(args: argparse.Namespace) -> list[dict]:
    check_repeats(args.repeats)
    device = pick_device(args.device)
    sync = device.type == "cuda"
    dtype_name, dtype = pick_dtype(args.dtype, device)
    sizes = visual_sizes(args.visual_tokens or ("2048,8192,32768" if sync else "2048,8192"))
    chosen = variants(args)
    model, text, rope_dims = build_decoder(args.model, args.num_layers, device, dtype, args.seed)
    layers = text.num_hidden_layers
    rows = []
    for visual in sizes:
        embeds, rope, layout = synthetic_prompt(visual, rope_dims, text.hidden_size, device, dtype, args.seed)
        make = {REFERENCE: AttentionTimedFull}
        make |= {label: (lambda m=method, p=params: backends.make_backend(m, **p))
                 for label, (method, params) in chosen.items()}
        for m in make.values():  # warm-up
            prefill(model, m(), layers, embeds, rope, layout, sync)
        times = {name: [] for name in make}
        attention_s, last = [], {}
        for r in range(args.repeats):  # rounds in rotated order, so drift hits every method alike
            for name in rotated(list(make), r):
                backend = make[name]()
                seconds, hooks_s, cache = prefill(model, backend, layers, embeds, rope, layout, sync)
                times[name].append(seconds)
                if name == REFERENCE:
                    attention_s.append(hooks_s)
                last[name] = (backend, cache.nbytes(), fastv_rows_share(cache, layers))
                del cache
        share = Spread.paired(attention_s, times[REFERENCE])
        for label, (method, params) in chosen.items():
            backend, held, rows_share = last[label]
            row = {"model": args.model, "layers": layers, "hidden_size": text.hidden_size, "device": str(device),
                   "dtype": dtype_name, "threads": torch.get_num_threads(), "visual_tokens": visual,
                   "prompt_tokens": embeds.shape[1], "method": method, "params": backend.config,
                   "repeats": args.repeats, "full_s": statistics.median(times[REFERENCE]),
                   "method_s": statistics.median(times[label]),
                   **Spread.paired(times[label], times[REFERENCE]).fields("prefill_ratio"),
                   **Spread.paired(times[REFERENCE], times[label]).fields("speedup"),
                   **share.fields("attention_share"), "kv_ratio": held / last[REFERENCE][1]}
            if "tau" in params:  # ZipVL: the attention among its important tokens only
                ratios = backend.report.important_ratio or [1.0] * layers
                skipped = 1 - sum(r * r for r in ratios) / len(ratios)  # of the causal attention's pairs
                ideal = Spread.of(1 - a / f * skipped for a, f in zip(attention_s, times[REFERENCE]))
                row |= {"tau": label, "zipvl_s": row["method_s"], **ideal.fields("ideal"),
                        "important_ratio": sum(ratios) / len(ratios), "important_ratio_per_layer": ratios}
            else:  # FastV: the layers after K run on the kept rows; the rest of the work is per row
                row |= {"rows_share": rows_share, "ideal": rows_share, "ideal_range": [rows_share, rows_share]}
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = (f"{r0['model']}, {r0['layers']} layers x {r0['hidden_size']}, {r0['device']} {r0['dtype']}, "
            f"{r0['threads']} thread(s), {r0['repeats']} rounds; ratio = method / full (< 1: its prefill pays), "
            "speedup = full / method; attn: attention's share of the full prefill; ideal: the ratio if the skipped "
            "work were free (ZipVL: the attention among unimportant tokens; FastV: the rows after layer K); "
            "kept: ZipVL's important ratio, FastV's rows over all layers")
    cells = [["method", "visual", "prompt", "setting", "kept", "full_s", "method_s", "ratio", "speedup", "attn",
              "ideal", "kv_ratio"]]
    for r in rows:
        spread = {name: Spread(r[name], *r[f"{name}_range"], r["repeats"])
                  for name in ("prefill_ratio", "speedup", "attention_share", "ideal")}
        zipvl = "tau" in r  # a row of a tau sweep (ZipVL); else FastV's K and R
        setting = f"tau {r['tau']}" if zipvl else f"K {r['params']['k_layer']}, R {r['params']['prune_ratio']}"
        cells.append([r["method"], str(r["visual_tokens"]), str(r["prompt_tokens"]), setting,
                      f"{r['important_ratio'] if zipvl else r['rows_share']:.3f}", f"{r['full_s']:.3f}",
                      f"{r['method_s']:.3f}", spread["prefill_ratio"].cell(), spread["speedup"].cell(),
                      spread["attention_share"].cell(), spread["ideal"].cell() if zipvl else f"{r['ideal']:.3f}",
                      f"{r['kv_ratio']:.3f}"])
    return "\n".join([head, SPREAD_NOTE] + aligned(cells))


def main(argv=None) -> int:
    return run_main(parse_args, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
