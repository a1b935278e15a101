"""Rotary positions of a Qwen2-VL / Qwen2.5-VL prompt (M-RoPE: time, row and column per token).

Text tokens carry one position on all three components, counting on by one. An image or a video
block (a run of its placeholder tokens) is placed from the current position: a token at temporal
step t, row r and column c of the merged grid sits at (start + time(t), start + r, start + c), where
time(t) is t for Qwen2-VL and, for Qwen2.5-VL, t x the block's seconds per temporal step x the
model's ``tokens_per_second`` (absolute time: a long or slow video spreads further), truncated.

Where the text after a block goes on is the rule that matters:

* ``LARGEST_POSITION``: at the block's largest position + 1, so text never sits below a visual
  token it follows. The Qwen authors' rule, and transformers' up to 5.2 (and Qwen3-VL's in effect,
  whose frames are one-step blocks); what real checkpoints were trained on.
* ``FRAME_EXTENT``: at the block's start + max(rows, columns), whatever the video's length in time
  (transformers 5.3 to 5.24). For an image both rules agree; after a video whose time ids pass its
  frame's size the question lands among the video's positions. The bundled tiny-arena-vl was
  trained on it and keeps it (its config's ``rope_text_after_media``).

Under both, the token after the chunk (the next chunk, the first decode step) sits at the chunk's
largest position + 1, as the model's rope deltas place its decode steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import torch

from ..errors import UserError

RULE_KEY = "rope_text_after_media"  # a model config's attribute naming its rule (absent: the authors')
LARGEST_POSITION = "largest_position"
FRAME_EXTENT = "frame_extent"
RULES = (LARGEST_POSITION, FRAME_EXTENT)

TEXT, IMAGE, VIDEO = 0, 1, 2  # token types, as transformers' mm_token_type_ids


def rule_of(config) -> str:
    """The rule a model ``config`` was trained with: its ``rope_text_after_media``, else the authors'."""
    rule = getattr(config, RULE_KEY, None) or LARGEST_POSITION
    if rule not in RULES:
        raise UserError(f"The model's config names {RULE_KEY} '{rule}'; this engine knows {', '.join(RULES)}.")
    return rule


def temporal_ids(steps: int, step: float) -> torch.Tensor:
    """Temporal ids of ``steps`` grid steps ``step`` apart, truncated; in float32 as transformers
    computes them, so a fractional step lands on the same integers."""
    return (torch.arange(steps, dtype=torch.float32) * torch.tensor(step, dtype=torch.float32)).long()


def block_positions(start: int, grid: Sequence[int], step: float = 1.0) -> torch.Tensor:
    """(3, t*h*w) positions of one block of ``grid`` (t, h, w in merged tokens, time-major then
    rows then columns, as the placeholders are laid out) placed from ``start``."""
    t, h, w = (int(x) for x in grid)
    time, row, col = torch.meshgrid(temporal_ids(t, step), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([time, row, col]).reshape(3, -1) + start


def mrope_positions(types: Sequence[int], image_grids: Sequence[Sequence[int]] = (),
                    video_grids: Sequence[Sequence[int]] = (), video_steps: Sequence[float] = (),
                    start: int = 0, rule: str = LARGEST_POSITION) -> tuple[torch.Tensor, int]:
    """(3, len(types)) positions of a chunk whose first token sits at ``start``, and the position
    of the token after it. ``types``: TEXT, IMAGE or VIDEO per token; each run of IMAGE (VIDEO)
    tokens takes the next of ``image_grids`` (``video_grids``: t, h, w in merged tokens) and must
    hold its t*h*w tokens; ``video_steps``: each video's time id per temporal step (default 1)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule '{rule}'; known rules: {', '.join(RULES)}")
    grids = {IMAGE: iter(image_grids), VIDEO: iter(video_grids)}
    steps = iter(video_steps)
    parts, here = [], start
    for kind, run in groupby(types):
        length = len(list(run))
        if kind == TEXT:
            parts.append(torch.arange(here, here + length).expand(3, -1))
            here += length
            continue
        grid = next(grids[kind], None)
        if grid is None or length != int(grid[0]) * int(grid[1]) * int(grid[2]):
            raise ValueError(f"a run of {length} {'image' if kind == IMAGE else 'video'} tokens does not match "
                             f"its grid {None if grid is None else tuple(int(x) for x in grid)}")
        block = block_positions(here, grid, float(next(steps, 1.0)) if kind == VIDEO else 1.0)
        parts.append(block)
        here = int(block.max()) + 1 if rule == LARGEST_POSITION else here + max(int(grid[1]), int(grid[2]))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long), start
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1


def model_positions(config, types: Sequence[int], image_grids: Sequence[Sequence[int]] = (),
                    video_grids: Sequence[Sequence[int]] = (), seconds_per_step: Sequence[float] = (),
                    start: int = 0) -> tuple[torch.Tensor, int]:
    """:func:`mrope_positions` for a Qwen-VL model's ``config``: the grids as its processor gives them
    (t, h, w in patches: merged by ``spatial_merge_size`` here), each video's seconds per temporal step
    (Qwen2.5-VL's ``second_per_grid_ts``, times ``tokens_per_second``), and the rule it was trained with."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    merged = lambda grids: [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grids]  # noqa: E731
    steps = [vision.tokens_per_second * s for s in seconds_per_step]
    return mrope_positions(types, merged(image_grids), merged(video_grids), steps, start, rule_of(config))

