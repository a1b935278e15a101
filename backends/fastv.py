"""FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference
Acceleration for Large Vision-Language Models", ECCV 2024, arXiv 2403.06764, Sec. 4.1): after the
first K decoder layers, the visual tokens that get the least attention are dropped for every later
layer: they are neither computed nor cached there.

* Score (Sec. 4.1): the attention the visual tokens of the prompt receive in layer K (the K-th,
  counted from 1: the last one that runs on every token), averaged over the query heads. Whose
  attention counts differs between the paper and the authors' code: the paper averages what a
  token receives from all tokens, the code takes the last prompt token's row. We follow the code
  (and the issue): one softmax row per layer instead of the T x T map, and the token that produces
  the first logit is the one asking.
* Prune (Sec. 4.1): of the chunk's n visual tokens (every image and video of it, ranked together;
  the code has one image), the round((1 - R) n) best are kept, R = 50% (Sec. 5, "K=2, R=50%"); text
  tokens and the last prompt token are always kept. The count follows the authors' code, which sets
  its attention rank with Python's ``round`` (halves to even: n = 5 at R = 50% keeps 2, where
  ceil would keep 3); the paper gives no rounding. A share small enough to round to 0 keeps none.
* Layers K+1 .. L run on the kept rows only (``narrows_prefill``): the runtime shortens the hidden
  states, the rotary tables and the positions before layer K+1 (``kv_arena.runtime.narrowing``), so
  the prefill itself is cheaper, not just the cache, and those layers cache the kept tokens at
  their original positions (M-RoPE included), which decoding keeps using. The first K layers keep
  every token: their cache is the full cache's.
* A later prompt (a second turn) prunes its own visual tokens; one without any runs in full. A
  model with at most K layers prunes nothing.

No budget: FastV's knobs are K and R, named parameters; the bytes it holds follow from them (layers
after K hold text plus (1 - R) of the visual tokens), so it is compared at the fraction it realises
(``report.realised_fraction``), like ZipVL. ``prune_ratio`` 0 keeps every token: the full cache.

Report (the base :class:`~backends.base.Report`): ``kept`` (per layer, the token positions held),
``layer_budgets`` (per layer, entries held / tokens seen), ``realised_fraction`` (bytes held / the
full cache's for the same tokens, all layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_math import attention_probs
from .base import AttentionCall, KVBackend, KVLayer
from .params import param


def last_token_attention(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """(S,) float32 attention the last new query gives each held key, averaged over query heads
    (it sees every key: it is the last one)."""
    return attention_probs(query[:, :, -1:], key, scaling)[:, 0].mean(dim=0)


def kept_rows(scores: torch.Tensor, visual: torch.Tensor, prune_ratio: float) -> torch.Tensor:
    """Ascending row indices kept of a prompt chunk: every non-visual row, the last row, and the
    :func:`kept_count` best-``scores`` rows of the n ``visual`` (bool) ones."""
    visual = visual.clone()
    visual[-1] = False  # the last prompt token produces the first logit: never dropped
    candidates = visual.nonzero().flatten()
    keep = kept_count(candidates.numel(), prune_ratio)
    return rows_kept(visual, scores[candidates].topk(keep).indices)


def kept_count(visual: int, prune_ratio: float) -> int:
    """Visual tokens kept of ``visual``: round((1 - R) n), Python's round as in the authors' code."""
    return round((1 - prune_ratio) * visual)


def rows_kept(visual: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Ascending rows of a prompt chunk that go on: every non-``visual`` (bool) row and the visual
    rows at ``kept``, indices among the chunk's visual tokens in order (FastV's and VisionZip's)."""
    rows = ~visual
    rows[visual.nonzero().flatten()[kept]] = True
    return rows.nonzero().flatten()


@dataclass(eq=False)
class FastV(KVBackend):
    name = "fastv"
    title = "FastV"
    does = "drops"
    chooses_tokens = True
    paper = "https://arxiv.org/abs/2403.06764"
    summary = ("After layer K (2), drops the visual tokens the last prompt token attends to least (R = 50% of "
               "them) for every later layer: the prefill runs on fewer tokens and their cache is smaller. No "
               "budget: the memory it saves follows from K and R.")
    prune_ratio: float = param(0.5, "Share R of the visual tokens dropped after layer K (Sec. 5: 50%; 0 keeps "
                               "every token).", 0.0, 1.0, 0.05)
    k_layer: int = param(2, "Layers that run on every token; the attention in the last of them ranks the visual "
                         "tokens (Sec. 5: K = 2).", 1, 128, 1)
    uses_budget = False
    lossless_params: ClassVar[dict] = {"prune_ratio": 0.0}
    shortens_prefill: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._rows: torch.Tensor | None = None  # rows chosen in layer K, handed over before layer K + 1

    @property
    def narrows_prefill(self) -> bool:
        return self.prune_ratio > 0

    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        scoring_layer = call.layer_idx == self.k_layer - 1 and self.k_layer < call.num_layers
        if call.is_prefill and scoring_layer and self.narrows_prefill:
            self._rows = self.choose(call, query, key, scaling)

    def choose(self, call: AttentionCall, query, key, scaling: float) -> torch.Tensor | None:
        """Rows of the chunk that go on after this layer (None: all, when it has no visual token)."""
        visual = call.layout.visual_mask(query.device) if call.layout is not None else None
        if visual is None or visual.shape[0] != query.shape[2] or not visual[:-1].any():
            return None
        scores = last_token_attention(query, key, scaling)[-query.shape[2]:]  # the chunk's own keys
        return kept_rows(scores, visual, self.prune_ratio)

    def prefill_rows(self, call: AttentionCall) -> torch.Tensor | None:
        if call.layer_idx != self.k_layer:
            return None
        rows, self._rows = self._rows, None
        return rows

    def after_forward(self, cache, call: AttentionCall) -> None:
        self._rows = None
        layers, report = cache.layers, self.report
        report.kept = [layer.positions for layer in layers]
        report.layer_budgets = [layer.get_seq_length() / call.seen for layer in layers]
        full = layers[0].nbytes() * len(layers)  # the first layer never drops a token: the full cache's layer
        report.realised_fraction = cache.nbytes() / full if full else None
