"""Where everything sits in one prefill chunk: the system prompt, each image and video (with a
video's frames), and the text, in absolute token indices of the conversation. The runtime builds a
:class:`PromptLayout` for every chunk it prefills and hands it to the method with each attention
call (``AttentionCall.layout``); methods that treat visual tokens apart read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Span = tuple[int, int]  # [start, end) in absolute token index of the conversation


@dataclass
class VisualSpan:
    """One image or video. A video's frames may be separated by text (Qwen3-VL's timestamps):
    ``span`` runs from its first visual token to its last, ``token_spans`` are the visual tokens."""

    kind: str  # "image" or "video"
    span: Span
    frames: list[Span] = field(default_factory=list)  # one span per (merged) frame of a video
    grid: tuple[int, int, int] | None = None  # (t, h, w) in visual tokens, for overlays

    @property
    def token_spans(self) -> list[Span]:
        return self.frames or [self.span]

    @property
    def length(self) -> int:
        """Visual tokens (text between frames not counted)."""
        return sum(end - start for start, end in self.token_spans)


@dataclass
class PromptLayout:
    """Where everything sits in one prefill chunk (absolute token indices of the conversation)."""

    start: int  # index of the chunk's first token
    end: int  # one past its last token
    system: Span | None = None
    visuals: list[VisualSpan] = field(default_factory=list)
    text: list[Span] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def images(self) -> list[VisualSpan]:
        return [v for v in self.visuals if v.kind == "image"]

    @property
    def videos(self) -> list[VisualSpan]:
        return [v for v in self.visuals if v.kind == "video"]

    @property
    def post_vision(self) -> Span:
        """Tokens after the last visual token (the whole chunk if it has no visual token)."""
        last = max((v.span[1] for v in self.visuals), default=self.start)
        return (last, self.end)

    def visual_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool mask over the chunk's tokens: True where the token is visual."""
        mask = torch.zeros(self.length, dtype=torch.bool, device=device)
        for v in self.visuals:
            for first, end in v.token_spans:
                mask[first - self.start : end - self.start] = True
        return mask
