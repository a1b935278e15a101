"""EVS, Efficient Video Sampling ("Efficient Video Sampling: Pruning Temporally Redundant Tokens for
Faster VLM Inference", NVIDIA, arXiv 2510.14624), as vLLM serves it for Qwen2.5-VL and Qwen3-VL
(``--video-pruning-rate``, ``vllm/multimodal/evs.py``; SGLang ships the same): a video's tokens that
barely changed since the previous frame never enter the language model.

* Score (vLLM's ``compute_retention_mask``): the video's embeddings as the vision tower hands them to
  the language model (one per merged patch, a frame being one temporal patch of Qwen-VL: two
  sampled frames), laid out (T, h, w); each token's dissimilarity is 1 - cosine similarity with the
  token at the same place in the previous frame. The first frame's tokens score 255, so they are
  always kept whole.
* Count (vLLM's ``compute_retained_tokens_count``): at pruning rate q a video of T frames of h x w
  tokens keeps max(h x w, int(T x h x w x (1 - q))) tokens: the most dissimilar ones (a stable sort,
  descending, so ties keep the earlier token), the first frame included; the rest are dropped.
* Where: before the first decoder layer (``narrows_prefill``, ``prefill_rows`` at layer 0, reading
  ``call.hidden``: the prompt's input embeddings, the video's as its tower made them), so the dropped
  tokens are neither computed nor cached by any layer, as in vLLM where they never reach the
  decoder. Kept tokens keep their original positions (M-RoPE included), as vLLM recomputes them
  (``recompute_mrope_positions``); text after the video keeps its own.
* Pictures and text pass through unchanged: EVS prunes video tokens only. A prompt without a video
  holds the whole cache, and the method says so (``report.note``, shown beside its figures) rather
  than show 1.00x as a result.

Where we depart from vLLM:

* The knob is the budget, the fraction of the full cache's KV bytes, as for every method on that
  axis; the pruning rate follows from it: q = (tokens the budget removes from the prompt) / (the
  prompt's video tokens), capped at 1, the same q for every video of the prompt, then vLLM's count
  (so the first frame can hold the cache above the budget). vLLM's ``--video-pruning-rate q`` is
  budget = 1 - q x (the video's share of the prompt); the rate used is reported.
* vLLM builds the prompt with the pruned placeholder count; the runtime builds the whole prompt and
  drops the rows before the first layer, which computes and caches the same tokens at the same
  positions. Qwen3-VL's DeepStack features follow the kept rows (``kv_arena.runtime.narrowing``).
* The scores: computed here in float32 they equal the exact rule; vLLM computes them in the model's
  dtype on a GPU (bfloat16), where most dissimilarities round to a few values and tie, and the
  stable sort then keeps the earlier frames' tokens: on synthetic videos the kept sets overlap the
  exact rule's 0.40-0.98, the less the stiller the video (``python -m tools.evs_dtype``, this CPU's
  bfloat16). "As vLLM" here is the rule, not its bf16 ties.
* Any model's video is pruned the same way (LLaVA's videos are frames of images: a frame is one).
  Through ``kv_arena.hf`` a video's layout is read from the token ids, without its frame grid:
  nothing is pruned there, and the note says so. A streamed video is not supported (no cap).

Budget 1.0 prunes nothing: the full cache. Report (:class:`EVSReport`): ``kept`` (per layer, the
positions held), ``layer_budgets`` (per layer, entries held / tokens seen), ``pruning_rate`` (q of the
last prompt with a video), ``video_tokens`` and ``kept_video_tokens`` (of that prompt), ``note``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import AttentionCall, KVBackend, Report
from .fastv import rows_kept
from .layout import PromptLayout, VisualSpan

PICTURES_ONLY = ("EVS prunes video tokens only: this prompt has no video, so its pictures passed through unchanged "
                 "and it held the whole cache (not a result of compression).")
PICTURES_TOO = "EVS pruned the video's tokens; the pictures passed through unchanged."
NO_GRID = "EVS found no frame grid for this video (a layout read from token ids), so it pruned nothing."


def retained_count(per_frame: int, frames: int, rate: float) -> int:
    """Tokens a video of ``frames`` frames of ``per_frame`` tokens keeps at pruning rate ``rate``:
    int(frames x per_frame x (1 - rate)), never fewer than one whole frame (vLLM's count)."""
    return max(per_frame, int(frames * per_frame * (1 - rate)))


def retention_mask(embeds: torch.Tensor, rate: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(T, N) bool: the tokens a video of (T, N, C) ``embeds`` (T frames of N tokens, each frame in the
    same spatial order) keeps at pruning rate ``rate``: the first frame, then the most dissimilar
    (1 - cosine with the same place one frame earlier), :func:`retained_count` in all. The scores are
    computed in ``dtype``: float32 is the exact rule; vLLM's is the model's (``tools/evs_dtype.py``)."""
    frames, per_frame = embeds.shape[:2]
    dissimilarity = torch.full((frames, per_frame), 255.0, dtype=dtype, device=embeds.device)  # the first frame: kept
    if frames > 1:
        dissimilarity[1:] = 1 - F.cosine_similarity(embeds[1:].to(dtype), embeds[:-1].to(dtype), dim=-1)
    order = dissimilarity.flatten().argsort(descending=True, stable=True)
    mask = torch.zeros(frames * per_frame, dtype=torch.bool, device=embeds.device)
    mask[order[: retained_count(per_frame, frames, rate)]] = True
    return mask.view(frames, per_frame)


def frame_grid(video: VisualSpan) -> tuple[int, int] | None:
    """(frames, tokens per frame) of a video whose layout knows them, else None."""
    if video.grid is None or math.prod(video.grid) != video.length or not video.frames:
        return None
    frames = video.grid[0]
    return (frames, video.length // frames) if frames == len(video.frames) else None


@dataclass
class EVSReport(Report):
    """The base report (``kept``, ``layer_budgets``, ``note``) and what the last video prompt pruned."""

    # q: the share of the prompt's video tokens the budget asked to prune
    pruning_rate: float | None = None
    # the prompt's video tokens, and those kept (the first frames whole)
    video_tokens: int | None = None
    kept_video_tokens: int | None = None


@dataclass(eq=False)
class EVS(KVBackend):
    name = "evs"
    title = "EVS (Efficient Video Sampling)"
    does = "drops"
    chooses_tokens = True
    paper = "https://arxiv.org/abs/2510.14624"
    summary = ("Drops the video tokens that barely changed since the previous frame (cosine of the vision "
               "encoder's embeddings at the same place) before the language model reads them, the first frame "
               "kept whole, as vLLM's --video-pruning-rate for Qwen2.5-VL and Qwen3-VL; the rate follows from the "
               "budget. Pictures and text pass through unchanged.")
    report_type: ClassVar[type[Report]] = EVSReport

    @property
    def narrows_prefill(self) -> bool:
        return self.budget < 1

    def pruning_rate(self, layout: PromptLayout, video_tokens: int) -> float:
        """q: the tokens ``budget`` removes from the prompt, as a share of its video tokens (at most 1)."""
        drop = layout.length - self.budget_tokens(layout.length)
        return min(1.0, drop / video_tokens) if video_tokens else 0.0

    def prefill_rows(self, call: AttentionCall) -> torch.Tensor | None:
        if call.layer_idx != 0:
            return None
        layout, report = call.layout, self.report
        report.note = None
        if layout is None or call.hidden is None or call.hidden.shape[1] != layout.length:
            return None
        if not layout.videos:
            report.note = PICTURES_ONLY if layout.images else None
            return None
        videos = [(v, frame_grid(v)) for v in layout.videos]
        tokens = sum(v.length for v, grid in videos if grid is not None)
        if tokens == 0:
            report.note = NO_GRID
            return None
        rate = self.pruning_rate(layout, tokens)
        kept, offset = [], 0
        for video, grid in videos:
            if grid is None:
                kept.append(torch.arange(video.length) + offset)
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in video.token_spans]) - layout.start
                embeds = call.hidden[0, rows.to(call.hidden.device)].view(*grid, -1)
                kept.append(retention_mask(embeds, rate).flatten().nonzero().flatten().cpu() + offset)
            offset += video.length
        kept = torch.cat(kept)
        report.pruning_rate, report.video_tokens, report.kept_video_tokens = rate, offset, int(kept.numel())
        report.note = PICTURES_TOO if layout.images else None
        if kept.numel() == offset:
            return None
        video_rows = torch.zeros(layout.length, dtype=torch.bool)
        for video in layout.videos:
            for a, b in video.token_spans:
                video_rows[a - layout.start:b - layout.start] = True
        return rows_kept(video_rows, kept)

    def after_forward(self, cache, call: AttentionCall) -> None:
        if call.is_prefill:
            self.report.kept = [layer.positions for layer in cache.layers]
            self.report.layer_budgets = [layer.get_seq_length() / call.seen for layer in cache.layers]
