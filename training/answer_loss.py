"""The loss of tiny-arena-vl's question-answering training, shared by its scripts (v2's
train_arena.py, v3's train_arena_v3.py): a batch of chats padded into tensors, the training
evictions as an attention mask, and the cross-entropy on the answer tokens with whether each turn's
answer is right.

A chat (a script's Sequence) gives: ``ids``, ``answers`` (per turn: (index that predicts, token)
for the answer and its end of turn), ``hidden`` (sequence indices the questions do not see) and
``after`` (where the questions begin).
"""

from __future__ import annotations

import torch


def padded(seqs, positions: list[torch.Tensor], pad: int):
    """(ids, M-RoPE positions, labels) of the chats side by side, each padded to the longest:
    padding gets positions past the chat's own (never attended) and no label (-100)."""
    n, width = len(seqs), max(len(s.ids) for s in seqs)
    ids = torch.full((n, width), pad, dtype=torch.long)
    pos = torch.zeros(3, n, width, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, positions)):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        pos[:, i, : len(s.ids)] = p
        pos[:, i, len(s.ids):] = p.max() + 1 + torch.arange(width - len(s.ids))
        for turn in s.answers:
            for at, token in turn:
                labels[i, at] = token
    return ids, pos, labels


def hidden_mask(seqs, width: int) -> torch.Tensor | None:
    """Causal mask with each chat's ``hidden`` keys masked from ``after`` on: exactly what a method's
    eviction after the media's prefill does; None when nothing is hidden (plain causal attention)."""
    if not any(s.hidden for s in seqs):
        return None
    mask = torch.ones(width, width, dtype=torch.bool).tril().expand(len(seqs), 1, width, width).clone()
    for i, s in enumerate(seqs):
        if s.hidden:
            mask[i, 0, s.after:, torch.tensor(s.hidden)] = False
    return mask


def answer_loss(model, seqs, embeds: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor, mask):
    """The decoder on ``embeds``: (cross-entropy over the answer tokens; per chat and turn, whether
    every answer token and the end of turn is the argmax, which teacher-forced is greedy decoding
    getting the whole answer right; the logits at every answered position, in sequence order)."""
    hidden = model.model.language_model(inputs_embeds=embeds, position_ids=pos, attention_mask=mask,
                                        use_cache=False).last_hidden_state
    answer = labels != -100
    logits = model.lm_head(hidden[answer])
    loss = torch.nn.functional.cross_entropy(logits, labels[answer])
    right = torch.ones_like(labels, dtype=torch.bool)
    right[answer] = logits.argmax(-1) == labels[answer]
    right = right.cpu()  # one copy from an accelerator, not one per answer token
    hits = [[all(bool(right[i, at]) for at, _ in turn) for turn in s.answers] for i, s in enumerate(seqs)]
    return loss, hits, logits
