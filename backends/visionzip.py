"""VisionZip (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models",
CVPR 2025, arXiv 2412.04467, Sec. 3.2): before the decoder, each image keeps the tokens its vision
tower attends to most (dominant tokens) and a few contextual tokens into which the rest are merged
by key similarity; the decoder, and so the cache, only ever see those.

* Dominant tokens (Sec. 3.2, "Dominant Token Selection"): the attention the CLS token gives each
  patch in the tower layer the projector reads (LLaVA-1.5: the second to last, ``vision_feature_layer``
  -2), averaged over heads; the ``dominant`` best patches stay as they are. The authors' code also
  keeps the CLS token's own feature; LLaVA-1.5 as transformers runs it has a placeholder for each
  patch only, so we keep patches only.
* Contextual tokens (Sec. 3.2, "Contextual Tokens Merging"): among the remaining patches, in image
  order, ``contextual`` targets evenly spaced (every (remaining // contextual)-th, from the first);
  every other remaining patch joins the target whose key is most similar (cosine of the keys
  averaged over heads, as the authors' code does) and each target becomes the plain mean of its
  group's features, the paper's averaging. (The authors' code adds the mean of the joined features
  to the target's instead; the two agree where nothing joined, e.g. whenever nothing is dropped.)
* Counts (Sec. 4, Table 1 on LLaVA-1.5, 576 tokens: 54 + 10 = 64, 108 + 20 = 128, 162 + 30 = 192):
  our knob is ``keep``, the share of each image's tokens kept, ceil(keep x N); of those, a share
  ``contextual_share`` (10 / 64 = 0.156, the same in all three settings) is contextual, rounded, the
  rest dominant. The default keep = 0.333 is the paper's 192 (162 + 30) of 576; 0.222 gives 128,
  0.111 gives 64. ``keep`` 1.0 keeps every token: the full cache.
* Positions: the decoder sees the kept tokens at their original positions (a merged token at its
  target's), in image order, through the runtime's narrowing before the first decoder layer; the
  authors' code packs them into a shorter prompt with new positions. Ours keeps each token where the
  model learnt to see it and the prompt's layout unchanged.
* Towers: the CLS attention needs a CLIP tower read by one projector (LLaVA-1.5); the runtime refuses
  the method on other models (Qwen-VL towers have no CLS token and attend in windows; SigLIP has no
  CLS; LLaVA-NeXT tiles the image) in one line, rather than substitute another score.
* Training-free: the paper's projector fine-tuning (VisionZip + FT) is not done.

No budget: it is compared at the fraction it realises, like FastV. Every layer holds the text, the
kept visual tokens and the decoded tokens. Report (the base :class:`~backends.base.Report`): ``kept``
(per layer, the token positions held), ``layer_budgets`` (per layer, entries held / tokens seen),
``realised_fraction`` (bytes held / the full cache's for the same tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import AttentionCall, KVBackend, VisionTokens
from .fastv import rows_kept
from .params import param


def cls_attention(cls_query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """(B, N) float32 attention the CLS token gives each patch, averaged over heads: ``cls_query``
    (B, H, D), ``keys`` (B, H, N + 1, D) with the CLS token's first (its softmax runs over all)."""
    logits = torch.einsum("bhd,bhnd->bhn", cls_query.float(), keys.float()) * scaling
    return logits.softmax(dim=-1).mean(dim=1)[:, 1:]


def split_counts(tokens: int, keep: float, contextual_share: float) -> tuple[int, int]:
    """(dominant, contextual) of an image of ``tokens``: ceil(keep x tokens) kept, at least one,
    ``contextual_share`` of them contextual (rounded half up)."""
    kept = min(tokens, max(1, math.ceil(keep * tokens - 1e-9)))
    contextual = math.floor(contextual_share * kept + 0.5)
    return kept - contextual, contextual


def evenly_spaced(count: int, among: int) -> torch.Tensor:
    """``count`` indices out of ``among`` (>= count), one every (among // count) from 0."""
    if count == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.arange(0, among, among // count)[:count]


def merge_contextual(features: torch.Tensor, keys: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The remaining tokens' ``features`` (R, C) and ``keys`` (R, D) merged into ``count`` targets:
    (their indices among the R, ascending; (count, C) features, each the mean of its target and
    the tokens whose key is most similar to that target's)."""
    targets = evenly_spaced(count, features.shape[0]).to(features.device)
    joining = torch.ones(features.shape[0], dtype=torch.bool, device=features.device)
    joining[targets] = False
    if count == 0:
        return targets, features[:0]
    unit = F.normalize(keys.float(), dim=-1)
    owner = (unit[joining] @ unit[targets].T).argmax(dim=-1)  # most similar target of each joining token
    groups = F.one_hot(owner, count).T.float()  # (count, joining); a matmul: index_add is slower on CPU
    sums = features[targets].float() + groups @ features[joining].float()
    sizes = groups.sum(dim=1) + 1
    return targets, (sums / sizes[:, None]).to(features.dtype)


def zip_image(features: torch.Tensor, attention: torch.Tensor, keys: torch.Tensor, dominant: int,
              contextual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image: (kept token indices, ascending; (N, C) features with each contextual target's
    replaced by its group's mean). ``attention`` (N,) ranks the dominant tokens, ``keys`` (N, D)
    group the rest."""
    chosen = attention.topk(dominant).indices
    rest = torch.ones(features.shape[0], dtype=torch.bool, device=features.device)
    rest[chosen] = False
    rest = rest.nonzero().flatten()
    targets, merged = merge_contextual(features[rest], keys[rest], contextual)
    out = features.clone()
    out[rest[targets]] = merged
    return torch.cat([chosen, rest[targets]]).sort().values, out


@dataclass(eq=False)
class VisionZip(KVBackend):
    name = "visionzip"
    title = "VisionZip"
    does = "drops, merges"
    chooses_tokens = True
    paper = "https://arxiv.org/abs/2412.04467"
    summary = ("Before the language model reads an image, keeps the image tokens the vision encoder's summary "
               "token attends to most, plus a few tokens that each average a group of similar others; the rest "
               "never enter the model (LLaVA-1.5 models only). No budget: the share of image tokens kept is its knob.")
    keep: float = param(0.333, "Share of each image's tokens kept (paper, LLaVA-1.5's 576: 0.333 = 192, 0.222 = 128, "
                        "0.111 = 64; 1.0 keeps every token).", 0.01, 1.0, 0.001)
    contextual_share: float = param(0.156, "Share of the kept tokens that are merged contextual tokens, the rest "
                                    "dominant (paper: 10 of 64, 0.156).", 0.0, 1.0, 0.001)
    uses_budget = False
    lossless_params: ClassVar[dict] = {"keep": 1.0}

    def __post_init__(self) -> None:
        super().__post_init__()
        self._kept: torch.Tensor | None = None  # indices among this pass's visual tokens, until layer 0

    @property
    def selects_visual_tokens(self) -> bool:
        return self.keep < 1

    @property
    def narrows_prefill(self) -> bool:
        return self.selects_visual_tokens

    def select_visual(self, tokens: VisionTokens) -> torch.Tensor:
        attention = cls_attention(tokens.cls_query, tokens.keys, tokens.scaling)
        keys = tokens.keys[:, :, 1:].mean(dim=1)  # (B, N, D): the patches' keys, averaged over heads
        images, n = tokens.features.shape[:2]
        dominant, contextual = split_counts(n, self.keep, self.contextual_share)
        kept, features = [], []
        for b in range(images):
            index, out = zip_image(tokens.features[b], attention[b], keys[b], dominant, contextual)
            kept.append(index.cpu() + b * n)  # among the pass's visual tokens, images in prompt order
            features.append(out)
        self._kept = torch.cat(kept)
        return torch.stack(features)

    def prefill_rows(self, call: AttentionCall) -> torch.Tensor | None:
        if call.layer_idx != 0 or self._kept is None:
            return None
        kept, self._kept = self._kept, None
        visual = call.layout.visual_mask() if call.layout is not None else None
        total = 0 if visual is None else int(visual.sum())
        if total == 0 or int(kept.max()) >= total:
            raise RuntimeError(f"VisionZip chose among {int(kept.max()) + 1}+ image tokens but the prompt has {total}")
        return rows_kept(visual, kept)

    def after_forward(self, cache, call: AttentionCall) -> None:
        self._kept = None
        layers, report = cache.layers, self.report
        report.kept = [layer.positions for layer in layers]
        report.layer_budgets = [layer.get_seq_length() / call.seen for layer in layers]
        full = sum(layer.nbytes() / layer.get_seq_length() * call.seen for layer in layers if layer.get_seq_length())
        report.realised_fraction = cache.nbytes() / full if full else None
