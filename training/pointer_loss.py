"""Stage 2 of tiny-arena-vl v3: an auxiliary loss that teaches the lookup hop directly.

Two runs of stage 2 (issue #45) read an object well when it is the only one in view (0.75-1.0) but
answered about one object in three in full view through 2,000 steps, and the attention shows why: at
the position that predicts the answer, no head of any layer favours the named object's tokens much
beyond their share of the objects' tokens (``python -m training.probe_v3 RUN --attention``).
The answer loss alone leaves that lookup on a plateau. Here, at the position that predicts each
answer word, ``--point-heads`` of decoder layer ``--point-layer`` are asked to attend to the tokens of
the object the word names (``Question.parts``: the core of the asked object, the cells that show its
shape; of both objects of a pair in turn; of each object of a list). The loss is ``-log`` of the
attention weight those tokens receive, taken from the logits, averaged over answer words and heads,
added to the answer loss at ``--point-weight``. The other heads and layers stay free.

That formed the lookups keyed by colour and by motion, never the one keyed by shape ("What colour
is the star?"), and ``python -m training.lookup_probe`` says why: a new head fitted on the frozen
run finds the star from the word "star" at the decoder's input (the tower's output), not from where
the answer is predicted, and not even from the word by the input of layer 1. So the lookup is also
taught in two hops through the question's word (:func:`hop_rows`, ``--hop-weight``): at each naming
word, heads of ``--find-layer`` (0, where the shapes are still plain) attend to the object it names;
where the answer word is predicted, heads of ``--relay-layer`` attend to that word.

It is a seam of transformers' ``AttentionInterface``: the text model runs ``POINTER_ATTENTION``,
which is transformers' own SDPA plus, inside :func:`pointing` for the chosen layer, the attention
weights of the few rows asked for (the rest of the matrix is never built). Nothing is added to the
model: the weights it saves load into the app unchanged.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kv_arena.tiny.drawn_scenes import COLOURS, SHAPES
from kv_arena.tiny.scene_items import Question


POINTER_ATTENTION = "arena_pointer"


@dataclass
class Pointing:
    """The rows one forward pass asks about, in layer ``layer``'s ``heads``: for each, (chat in the batch,
    the sequence index that predicts an answer word, the sequence indices of the tokens it names)."""

    layer: int
    heads: tuple[int, ...]
    rows: list[tuple[int, int, list[int]]]
    # per forward pass, (rows, heads): log of the weight on the named tokens, from the logits (a weight
    # taken first and clamped would stop the gradient where the head looks elsewhere: where it is needed)
    log_masses: list[torch.Tensor] = field(default_factory=list)

    def loss(self) -> torch.Tensor:
        return -torch.cat(self.log_masses).mean()

    def mass(self) -> torch.Tensor:
        """(rows, heads): the weight on the named tokens."""
        return torch.cat(self.log_masses).exp()

    def mean_mass(self) -> float:
        return float(self.mass().detach().mean()) if self.log_masses else 0.0


def rows_of(seqs) -> list[tuple[int, int, list[int]]]:
    """Every answer word of a batch of training chats (train_arena_v3's Sequence) that names an
    object (its question's ``parts``): the chat, the index that predicts the word, and the sequence
    indices of that object's tokens."""
    rows = []
    for b, s in enumerate(seqs):
        for turn, answer in zip(s.item.turns, s.answers):
            for (at, _), tokens in zip(answer, turn.parts):
                if tokens:
                    rows.append((b, at, [s.visual_at[k] for k in tokens]))
    return rows


NAMING = frozenset(SHAPES) | frozenset(COLOURS) | {"moves"}


def naming_words(q: Question) -> list[str]:
    """The words of ``q`` that name the objects its answer words are about, one per answer word, in
    order ("star" for "What colour is the star?", "red" for "Which shape is red?", "moves" for "Which
    shape moves?", both shapes of a pair); empty where they do not pair up ("What is in the picture?")."""
    words = [w for w in re.findall(r"[a-z]+", q.text.lower()) if w in NAMING]
    return words if len(words) == len(q.answer.split()) else []


def hop_rows(seqs) -> tuple[list, list]:
    """The two hops of a lookup through the question's word, as rows of two Pointings: (find) at the
    position of each naming word, the tokens of the object it names; (relay) at the position that
    predicts the answer word, that naming word."""
    find, relay = [], []
    for b, s in enumerate(seqs):
        for turn, answer, words_at in zip(s.item.turns, s.answers, s.words_at):
            for (at, _), word_at, tokens in zip(answer, words_at, turn.parts):
                if tokens:
                    find.append((b, word_at, [s.visual_at[k] for k in tokens]))
                    relay.append((b, at, [word_at]))
    return find, relay


_ACTIVE: ContextVar[tuple[Pointing, ...]] = ContextVar("arena_pointing", default=())


@contextmanager
def pointing(*ps: Pointing):
    """Collect the attention weights each of ``ps`` asks for during the forward passes inside."""
    token = _ACTIVE.set(ps)
    try:
        yield ps
    finally:
        _ACTIVE.reset(token)


def _named_log_mass(module, query, key, attention_mask, scaling, p: Pointing) -> torch.Tensor:
    """(rows, heads) log of the softmax weight on each row's named tokens, under the same mask as the
    pass: the log-sum-exp of the named tokens' logits less that of every allowed one."""
    b = torch.tensor([r[0] for r in p.rows], device=query.device)
    at = torch.tensor([r[1] for r in p.rows], device=query.device)
    heads = torch.tensor(p.heads, device=query.device)
    groups = getattr(module, "num_key_value_groups", 1)
    q = query[b, :, at][:, heads]  # (rows, heads, dim): advanced indices apart put the rows first
    k = key[b][:, heads // groups]  # (rows, heads, keys, dim)
    logits = torch.einsum("rhd,rhkd->rhk", q, k) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    keys = torch.arange(k.shape[2], device=query.device)
    allowed = keys[None, :] <= at[:, None]
    if attention_mask is not None:
        row_mask = attention_mask[b, 0, at, : k.shape[2]]
        allowed = allowed & (row_mask if row_mask.dtype == torch.bool else row_mask == 0)
    named = torch.zeros_like(allowed)
    for i, (_, _, tokens) in enumerate(p.rows):
        named[i, tokens] = True
    every = logits.masked_fill(~allowed[:, None, :], float("-inf")).logsumexp(-1)
    return logits.masked_fill(~(named & allowed)[:, None, :], float("-inf")).logsumexp(-1) - every


def pointer_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    for p in _ACTIVE.get():
        if p.rows and module.layer_idx == p.layer:
            p.log_masses.append(_named_log_mass(module, query, key, attention_mask, scaling, p))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(POINTER_ATTENTION, pointer_attention)
AttentionMaskInterface.register(POINTER_ATTENTION, sdpa_mask)
