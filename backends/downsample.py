"""Downsample: a smaller picture. Every picture and video frame is resized before the vision tower so
that it makes the budget's share of the visual tokens, as if the user had uploaded a smaller one; the
model then reads that shorter prompt with an ordinary full cache.

* What it does: the runtime asks :meth:`Downsample.media_scale` (the budget) and sizes each picture and
  frame as the model's processor would (Qwen-VL's ``smart_resize``: sides on the patch x merge grid,
  14 x 2 = 28 px, aspect kept, between the processor's min and max pixels), then takes the largest
  size on that grid with at most ``budget`` of those pixels (``ChatAdapter.scaled_size``; bicubic, as
  the processors resize). A 448 px picture (16 x 16 = 256 tokens) at budget 0.25 is read at 224 px (8 x 8
  = 64). The grid rounds down, so a picture makes at most the budget's share of its tokens, never
  fewer than the processor's min pixels allow.
* Query-agnostic: the question plays no part, and nothing is evicted afterwards: the cache holds
  every token of the smaller prompt, so the text (system prompt, question, markers) is held whole and
  the realised fraction of the full cache's KV bytes is a little above the budget (the text's share
  of the prompt x (1 - budget)). The figures compare it at the fraction it realises.
* Its bytes are the smaller prompt's: the full cache of the full-size prompt is the reference, as for
  every method. The prefill is cheaper too (fewer tokens through the tower and the decoder).
* Models: the Qwen-VL family (any size on the grid). A processor that sizes every picture to one fixed
  grid (LLaVA-1.5's 336 px crop, LLaVA-NeXT's tiles) makes as many tokens of a smaller picture; the
  runtime refuses the method there in one line (at budget 1.0 it changes nothing and runs anywhere).

Source: VTC-Bench (Liao et al., "Are We Using the Right Benchmark: An Evaluation Framework for Visual
Token Compression Methods", ACL 2026, arXiv 2510.07143, Sec. 1 and Fig. 1: downsampling the image
beats many visual-token compressors on Qwen2-VL at the same reduction). Budget 1.0: the media as the
processor sizes them, the full cache.

Report (the base :class:`~backends.base.Report`): ``kept`` (per layer, the positions held: every token
of the smaller prompt), ``layer_budgets`` (1.0: nothing is evicted from it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import AttentionCall, KVBackend


@dataclass(eq=False)
class Downsample(KVBackend):
    name = "downsample"
    title = "Downsample (smaller picture)"
    does = "downsamples"
    paper = "https://arxiv.org/abs/2510.07143"
    summary = ("Resizes every picture and video frame before the vision encoder so that it makes the budget's share "
               "of the visual tokens, as a smaller upload would; the smaller prompt is then held whole. "
               "Query-agnostic; Qwen-VL models (a LLaVA processor sizes every picture to one grid).")
    resizes_media = True

    def media_scale(self) -> float:
        return self.budget

    def after_forward(self, cache, call: AttentionCall) -> None:
        if call.is_prefill:
            self.report.kept = [layer.positions for layer in cache.layers]
            self.report.layer_budgets = [layer.get_seq_length() / call.seen for layer in cache.layers]
