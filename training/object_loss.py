"""Stage 2 of tiny-arena-vl v3: an auxiliary loss that makes every object token say which object it is
in, inside the decoder, so a question's word can find it.

With the pointer loss (pointer_loss.py) the lookups keyed by colour formed (shape questions, "Which
shape is red?", 0.96 at step 2,500), those keyed by shape and by motion did not (colour questions,
"What colour is the star?", and "Which shape moves?", near one object in three): colour is plain in
every token of an object, shape and motion are not, least of all in the tokens at its edge that see
a corner of it. Here linear heads read, at the input of decoder layer ``--object-layer``, every
visual token's object: its shape, colour and motion, on every cell the object's box overlaps (the
cells its questions name, edges included, which see only part of it: the decoder must gather the
object), background elsewhere. The loss is the cross-entropy averaged over object tokens plus
``BACKGROUND_WEIGHT`` times its average over background tokens, added at ``--object-weight``; its
gradient reaches the decoder layers below, which is the point: the keys a question's word meets carry
the object's shape and motion.

The heads start from stage 1's (train_arena_v3_eyes.py: the same width, read from the tower's output,
which is the decoder's input) and live outside the model, in ``object_heads.pt`` of the run with their
own optimiser: the model's weights load into the app unchanged. The decoder layer's input is read
by a forward pre-hook; nothing of the model is changed.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from .train_arena_v3_eyes import COLOURS, SHAPES, Heads, load_eyes

HEADS_FILE = "object_heads.pt"
BACKGROUND_WEIGHT = 0.3  # stage 1's: background is most of a picture, unweighted it drowns the objects


def object_targets(item) -> dict[str, torch.Tensor] | None:
    """Per visual token of ``item`` (in the model's order), class ids: 1 + the shape / colour of the
    object whose box overlaps its cell, motion 1 where that object moves between the token's two
    frames; 0 for background. None for out-of-scope pictures (they hold no objects)."""
    if item.kind == "unknown":
        return None
    n = item.visual_tokens()
    shape, colour, motion = (torch.zeros(n, dtype=torch.long) for _ in range(3))

    def mark(offset: int, picture, thing, moves: bool) -> None:
        for k in picture.cells_of(thing):
            shape[offset + k], colour[offset + k] = 1 + SHAPES.index(thing.shape), 1 + COLOURS.index(thing.colour)
            motion[offset + k] = int(moves)

    if item.video:  # a token spans frames 2g and 2g + 1: a thing in one of them only is the moving one
        per = item.pictures[0].token_count
        for g in range(len(item.pictures) // 2):
            a, b = item.pictures[2 * g], item.pictures[2 * g + 1]
            for frame, other in ((a, b), (b, a)):
                for t in frame.things:
                    mark(g * per, frame, t, t not in other.things)
    else:
        offset = 0
        for p in item.pictures:
            for t in p.things:
                mark(offset, p, t, False)
            offset += p.token_count
    return {"shape": shape, "colour": colour, "motion": motion}


@contextmanager
def layer_input(model, layer: int):
    """Inside: ``got[0]`` is the hidden states entering text decoder layer ``layer`` in the last pass."""
    got: list[torch.Tensor] = []

    def keep(module, args):
        got[:] = [args[0]]

    handle = model.model.language_model.layers[layer].register_forward_pre_hook(keep)
    try:
        yield got
    finally:
        handle.remove()


def object_loss(heads: Heads, hidden: torch.Tensor, seqs, targets: list) -> torch.Tensor | None:
    """The heads' loss on the visual tokens of the chats that have ``targets`` (None: out of scope)."""
    rows, cols, wanted = [], [], {name: [] for name in ("shape", "colour", "motion")}
    for b, (s, t) in enumerate(zip(seqs, targets)):
        if t is None:
            continue
        rows += [b] * len(s.visual_at)
        cols += s.visual_at
        for name, kept in wanted.items():
            kept.append(t[name])
    if not rows:
        return None
    x = hidden[torch.tensor(rows, device=hidden.device), torch.tensor(cols, device=hidden.device)]
    on = torch.cat(wanted["colour"]).to(hidden.device) != 0
    total = hidden.new_zeros(())
    for name, logits in heads(x).items():
        each = F.cross_entropy(logits, torch.cat(wanted[name]).to(hidden.device), reduction="none")
        total = total + (each[on].mean() if on.any() else 0.0) + BACKGROUND_WEIGHT * each[~on].mean()
    return total


def setup_heads(width: int, eyes: Path, out: Path, lr: float, device) -> tuple[Heads, torch.optim.Optimizer]:
    """The heads and their optimiser: resumed from ``out`` when a run saved them, else stage 1's heads."""
    heads = Heads(width)
    saved = Path(out) / HEADS_FILE
    state = torch.load(saved, map_location="cpu") if saved.is_file() else None
    heads.load_state_dict(state["heads"] if state else load_eyes(eyes)[1])
    heads.to(device)  # before the optimiser's state is loaded: it follows its parameters' device
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    if state:
        optimizer.load_state_dict(state["optimizer"])
    return heads, optimizer


def save_heads(heads: Heads, optimizer, out: Path) -> None:
    """Beside the run's checkpoint (written aside, then moved, as the weights are)."""
    tmp = Path(out) / (HEADS_FILE + ".tmp")
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    tmp.replace(Path(out) / HEADS_FILE)
