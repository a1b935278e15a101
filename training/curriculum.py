"""What the questions of a training chat may see, shared by tiny-arena-vl's training scripts: the
curriculum that reveals the other objects, then the background (``reveal``), and the evictions
hidden from the questions (``hide_for_training``), both as an attention mask from the question on,
exactly what a method's eviction after the media's prefill does."""

from __future__ import annotations

import numpy as np


def hide_for_training(seq, rng: np.random.Generator, share: float, objects: float = 0.0,
                      background: float = 0.0) -> None:
    """Evictions the questions of ``seq`` (a training script's Sequence: its ``item``, ``answers``,
    ``visual_at``, ``system``; what is hidden goes into its ``hidden``) do not see. The curriculum: ``objects`` / ``background``,
    the share of the objects no question of the chat asks about / of the background tokens hidden
    (see --reveal). Then, with probability ``share`` each, more of the background (a third of the
    time all of it) and a random part of the system prompt (never its first token). Out-of-scope
    pictures keep every token: "unknown" is learnt from how they look."""
    if seq.item.kind == "unknown":
        return
    asked = {k for q in seq.item.turns[:len(seq.answers)] for k in q.tokens}
    informative = set(seq.item.informative)
    if rng.random() < share:
        background = max(background, 1.0 if rng.random() < 1 / 3 else rng.random())
    for k, at in enumerate(seq.visual_at):
        rate = 0.0 if k in asked else objects if k in informative else background
        if rate and rng.random() < rate:
            seq.hidden.append(at)
    if rng.random() < share:
        rate = rng.random()
        seq.hidden += [k for k in range(seq.system[0] + 1, seq.system[1]) if rng.random() < rate]


def reveal(step: int, stages: tuple[int, int, int]) -> tuple[float, float]:
    """(other objects, background) hidden shares at ``step``: all hidden until stages[0], the other
    objects shown gradually until stages[1], then the background until stages[2]."""
    a, b, c = stages
    return float(np.clip((b - step) / max(1, b - a), 0, 1)), float(np.clip((c - step) / max(1, c - b), 0, 1))


def add_reveal_arg(parser, default: tuple[int, int, int]) -> None:
    """The ``--reveal A,B,C`` flag of :func:`reveal`, with a script's own default."""
    parser.add_argument("--reveal", type=lambda t: tuple(int(x) for x in t.split(",")), default=default,
                        help="A,B,C: the curriculum. Until step A a question sees only the visual tokens of the "
                             "objects its chat asks about (it learns to copy); the other objects appear gradually "
                             "until B (it learns to find the named one), then the background until C (it learns "
                             "to ignore it)")
