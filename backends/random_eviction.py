"""Random eviction: the visual tokens a layer keeps are drawn uniformly at random; the floor a method
that scores tokens must clear at the same bytes.

* What it does: after each prefill, every layer holds ``budget x tokens seen`` entries, as SnapKV
  does (the budget is the fraction of the full cache's KV bytes: every entry costs the same). The
  text (system prompt, question, chat markers, earlier answers) is always kept; the rest of the
  budget goes to visual tokens drawn uniformly at random, per layer and per KV head, as kvpress's
  ``RandomPress`` draws a uniform score for every head and entry and keeps the top ones (here only
  visual entries are candidates). Heads keep different tokens, the same count (``KVLayer.keep``
  with an (H_kv, S') index), so the memory is really freed. When the text alone is over the budget,
  every visual token goes and the cache holds the text: more than the budget, which the realised
  bytes show.
* Seeded, so a run repeats: the scores come from a generator seeded with ``seed``, the layer, and
  where the prompt sits in the conversation (its first token's index and the tokens seen), never
  from a global generator: the same conversation gets the same draw in the app, the benchmarks and
  ``kv_arena.hf``, on any device. Two prompts of the same length at the same place draw alike
  (the draw does not read the content, as a fixed seed would not).
* Later turns: the visual tokens of earlier prompts stay candidates, so a follow-up's prefill
  brings the whole cache back to ``budget x tokens seen``; decoded tokens are appended (the prompt
  is what is compressed).
* The one seam is :meth:`RandomEviction.score` (a uniform draw per KV head and entry); eviction is
  the top-k of those scores among the visual entries in ``after_attention``, right after each
  layer's attention, as SnapKV compresses.

Sources: the random-pruning baseline of UniPruneBench (Peng et al., "Can Visual Input Be Compressed?",
arXiv 2511.02650, finding (1) of its abstract: "random pruning is a surprisingly strong baseline"),
kvpress's ``RandomPress`` (uniform scores per head and entry). Budget 1.0 keeps every token: the full cache.

Report (the base :class:`~backends.base.Report`): ``kept`` (per layer, (H_kv, S) positions),
``layer_budgets`` (per layer, entries kept / tokens seen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionCall, KVBackend, KVLayer
from .params import param


def draw_seed(seed: int, call: AttentionCall) -> int:
    """The generator's seed for one layer of one prefill: ``seed``, the layer, where the prompt starts
    and the tokens seen (a hash of plain ints: the same in every process and on every device)."""
    return hash((seed, call.layer_idx, int(call.positions[0]), call.seen)) & (2**63 - 1)


def random_scores(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Uniform [0, 1) float32 scores of ``shape`` from a CPU generator seeded with ``seed``."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def keep_text_and_top(scores: torch.Tensor, candidate: torch.Tensor, count: int) -> torch.Tensor:
    """(H_kv, count) ascending indices per head: every entry that is no ``candidate`` (bool, (H_kv, S)),
    then the candidates with the highest ``scores``. ``count`` must cover the non-candidates, and
    every head must hold as many of them (text is never evicted, so it does)."""
    ranked = scores.float().masked_fill(~candidate, float("inf"))
    return ranked.topk(count, dim=-1).indices.sort(dim=-1).values


@dataclass(eq=False)
class RandomEviction(KVBackend):
    name = "random"
    title = "Random eviction"
    does = "drops"
    chooses_tokens = True
    paper = "https://arxiv.org/abs/2511.02650"
    summary = ("Keeps all the text and, up to the budget, visual tokens drawn uniformly at random (per layer and KV "
               "head, seeded so a run repeats): the baseline a method that chooses its tokens must beat.")
    seed: int = param(0, "Seed of the draw (with the layer and where the prompt sits): the same conversation keeps the "
                      "same tokens, run after run.", 0, 9999, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._visual = torch.zeros(0, dtype=torch.long)  # every visual token index fed so far (all prompts)

    def score(self, call: AttentionCall, layer: KVLayer) -> torch.Tensor:
        """(H_kv, S) scores of the entries ``layer`` holds: a uniform draw per KV head and entry
        (kvpress's RandomPress), seeded by :func:`draw_seed`."""
        return random_scores(tuple(layer.positions.shape), draw_seed(self.seed, call)).to(layer.positions.device)

    def note_visual(self, call: AttentionCall) -> None:
        """Remember the prompt's visual token indices (once per prefill, at its first layer); indices
        from this prompt's start on are another conversation's or an abandoned prefill's: forgotten."""
        if call.layer_idx != 0 or call.layout is None:
            return
        earlier = self._visual[self._visual < call.layout.start]
        self._visual = torch.cat([earlier, call.layout.visual_mask().nonzero().flatten() + call.layout.start])

    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        if not call.is_prefill:
            return
        self.note_visual(call)
        report = self.report
        report.ensure_layers(call.num_layers, "kept")
        report.ensure_layers(call.num_layers, "layer_budgets", fill=1.0)
        held = layer.get_seq_length()
        visual = torch.isin(layer.positions, self._visual.to(layer.positions.device))  # (H_kv, S)
        text = held - int(visual.sum(dim=-1).min()) if visual.any() else held
        count = max(text, self.budget_tokens(call.seen))
        if count < held:
            layer.keep(keep_text_and_top(self.score(call, layer), visual, count))
        report.kept[call.layer_idx] = layer.positions
        report.layer_budgets[call.layer_idx] = layer.get_seq_length() / call.seen
