"""Can a head learn the lookup on a run's frozen decoder? Tells a decoder with no room for a lookup
from one whose training has not found it.

    python -m training.lookup_probe runs/tiny-arena-vl-v3 --kind colour --layers 1,2,3 --dims 32,64

``probe_v3 --attention`` shows whether a head of the run attends to the object a question names when
the answer is predicted. When none does, either the decoder's input to that layer does not hold what
the lookup needs (the question's word at the answer's position, the object's shape in its tokens, in
directions that survive M-RoPE) or it holds it and training has not found the head. Here a new head,
queries and keys of ``--dims`` dimensions read from the layer's normalised input (as its own heads
read it) and turned by the model's M-RoPE scaled to that width, is fitted to attend to the named
object, the run frozen, on half the held-out chats of ``--kind``, and read on the other half: the
named object's share of the head's weight on all the objects (as ``--attention``), beside their token
share. A new head of the model's own width that reaches it says the room is there; one that reaches
it only wider says the head is too narrow; one that reaches it without M-RoPE only, that the turning
dimensions crowd the content out. With ``--query word`` the query is read at the question's word
that names the object instead: whether the objects' tokens hold what a word can match at all.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass

import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import rotate_half

from kv_arena.tiny import drawn_scenes as scenes
from . import train_arena_v3 as train
from .object_loss import layer_input
from .probe_v3 import load_run


@dataclass
class Rows:
    """One layer's normalised input for a set of chats, padded, with what each chat's answer names."""

    hidden: torch.Tensor  # (chats, length, width)
    positions: torch.Tensor  # (chats, 3, length) M-RoPE positions
    at: torch.Tensor  # (chats,) the query's index: where the answer's first word is predicted, or the naming word
    named: torch.Tensor  # (chats, length) bool: the named object's tokens
    objects: torch.Tensor  # (chats, length) bool: every object's tokens

    def split(self, k: int) -> tuple[Rows, Rows]:
        fields = (self.hidden, self.positions, self.at, self.named, self.objects)
        return Rows(*(t[:k] for t in fields)), Rows(*(t[k:] for t in fields))


@torch.no_grad()
def collect(model, adapter, kind: str, items: int, layers: list[int], query: str = "answer") -> dict[int, Rows]:
    """Per layer in ``layers``, the normalised input of the first question of ``items`` held-out chats;
    the query is read where the answer is predicted, or (``query="word"``) at the question's last word,
    the one that names the object ("star" in "What colour is the star?")."""
    pad = adapter.tokenizer.pad_token_id
    seqs = [train.encode(adapter, it) for it in scenes.held_out(kind, items, turns=1)]
    length = max(len(s.ids) for s in seqs)
    width = model.config.text_config.hidden_size
    out = {layer: Rows(torch.zeros(len(seqs), length, width), torch.zeros(len(seqs), 3, length),
                       torch.zeros(len(seqs), dtype=torch.long), torch.zeros(len(seqs), length, dtype=torch.bool),
                       torch.zeros(len(seqs), length, dtype=torch.bool)) for layer in layers}
    decoder = model.model.language_model.layers
    for start in range(0, len(seqs), 8):
        batch = seqs[start:start + 8]
        with contextlib.ExitStack() as stack:
            kept = {layer: stack.enter_context(layer_input(model, layer)) for layer in layers}
            train.forward(model, batch, pad)
        for layer, rows in out.items():
            normed = decoder[layer].input_layernorm(kept[layer][0])
            for b, s in enumerate(batch):
                i, n = start + b, len(s.ids)
                rows.hidden[i, :n] = normed[b, :n].float()
                rows.positions[i, :, :n] = s.positions.float()
                rows.at[i] = s.answers[0][0][0] if query == "answer" else s.words_at[0][0]
                rows.named[i, [s.visual_at[k] for k in s.item.question.tokens]] = True
                rows.objects[i, [s.visual_at[k] for k in s.item.informative]] = True
    return out


def rotary(positions: torch.Tensor, dim: int, theta: float, section: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (chats, length, dim): Qwen2.5-VL's M-RoPE at head width ``dim``, its
    ``section`` (temporal, height, width frequency pairs, given for the model's width) scaled to it."""
    half = dim // 2
    scaled = [half * s // sum(section) for s in section]
    scaled[-1] += half - sum(scaled)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    freqs = positions[..., None] * inv_freq  # (chats, 3, length, half)
    freqs = torch.cat([part[:, i % 3] for i, part in enumerate(freqs.split(scaled, dim=-1))], dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # as the model turns its queries and keys


class NewHead(torch.nn.Module):
    """A query and a key projection, as one of the model's heads (biases included), of ``dim`` dimensions."""

    def __init__(self, width: int, dim: int, rope: tuple[float, list[int]] | None):
        super().__init__()
        self.q, self.k, self.rope, self.dim = torch.nn.Linear(width, dim), torch.nn.Linear(width, dim), rope, dim

    def log_weights(self, rows: Rows) -> torch.Tensor:
        """(chats, length): log of the head's weight on each token at the query's position (causal)."""
        chats = torch.arange(len(rows.at))
        q, k = self.q(rows.hidden[chats, rows.at]), self.k(rows.hidden)
        if self.rope is not None:
            cos, sin = rotary(rows.positions, self.dim, *self.rope)
            q, k = _turn(q, cos[chats, rows.at], sin[chats, rows.at]), _turn(k, cos, sin)
        logits = torch.einsum("cd,cld->cl", q, k) * self.dim**-0.5
        allowed = torch.arange(logits.shape[1])[None, :] <= rows.at[:, None]
        return logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)


def named_share(log_weights: torch.Tensor, rows: Rows) -> float:
    """The named object's share of the weight on all the objects, averaged over chats."""
    w = log_weights.exp()
    return float(((w * rows.named).sum(-1) / (w * rows.objects).sum(-1).clamp_min(1e-9)).mean())


def fit(train_rows: Rows, test_rows: Rows, dim: int, rope, steps: int, seed: int = 0) -> tuple[float, float]:
    """Fit a new head to put its weight on the named object; its share (train, test) after ``steps``."""
    torch.manual_seed(seed)
    head = NewHead(train_rows.hidden.shape[-1], dim, rope)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        lw = head.log_weights(train_rows)
        loss = -lw.masked_fill(~train_rows.named, float("-inf")).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return named_share(head.log_weights(train_rows), train_rows), named_share(head.log_weights(test_rows), test_rows)


def token_share(rows: Rows) -> float:
    return float((rows.named.sum(-1) / rows.objects.sum(-1).clamp_min(1)).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a stage-2 run's folder (model.safetensors, config.json)")
    p.add_argument("--kind", default="colour", choices=[k for k in scenes.QUESTION_TYPES if k not in ("objects", "pair")])
    p.add_argument("--items", type=int, default=400, help="held-out chats: half to fit the new head, half to read it")
    p.add_argument("--layers", default="1,2,3", help="decoder layers whose input the new head reads")
    p.add_argument("--dims", default="32,64", help="widths of the new head")
    p.add_argument("--query", choices=("answer", "word"), default="answer",
                   help="where the new head's query is read: where the answer is predicted (the lookup), or at the "
                        "question's naming word (do the objects' tokens hold what the word names?)")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps (full batch) of each fit")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    loaded = load_run(args.run, args.threads)
    if loaded is None:
        return 2
    model, adapter = loaded
    text = model.config.text_config
    rope = (text.rope_parameters["rope_theta"], list(text.rope_parameters["mrope_section"]))
    layers = [int(x) for x in args.layers.split(",")]
    collected = collect(model, adapter, args.kind, args.items, layers, args.query)
    print(f"{args.kind}, query at the {args.query}: {args.items // 2} chats fitted, {args.items - args.items // 2} read; "
          f"token share {token_share(collected[layers[0]]):.2f}")
    print("| layer input | head width | M-RoPE | share, fitted chats | share, read chats |")
    print("|---|---|---|---|---|")
    for layer in layers:
        fitted, read = collected[layer].split(args.items // 2)
        for dim in (int(x) for x in args.dims.split(",")):
            for turned in (True, False):
                a, b = fit(fitted, read, dim, rope if turned else None, args.steps)
                print(f"| {layer} | {dim} | {'yes' if turned else 'no'} | {a:.2f} | {b:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
