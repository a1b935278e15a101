"""Train tiny-arena-vl on the mostly-background scenes, image sets and videos of kv_arena/tiny/arena_scenes.py.

    python -m training.train_arena --stop-at 2750 --threads 1

(the shipped run's command, about 1 h on a 2-core CPU; it writes runs/tiny-arena-vl, whose
config.json and model.safetensors are then copied into assets/tiny-arena-vl.)
Seeded: every batch is drawn from (--seed, step), so a run interrupted at any point and rerun with
the same flags resumes from the last checkpoint in --out (weights, optimizer, learning curve, saved
every --eval-every steps) and goes on exactly as it would have. Every --eval-every steps it prints
held-out accuracy per question type, for first questions and for follow-up questions in the same
chat, and the three probes (see evaluate), to the log and to training_curve.json.

The prompts are exactly the app's: the QwenVLAdapter's chat markers, the default system prompt, the
media's placeholder tokens and M-RoPE positions (kv_arena/runtime/mrope_positions.py, as the adapter computes them), and
a follow-up turn opened by the previous answer's end-of-turn token, as kv_arena/runtime/generate.py feeds it
(tests/test_tiny_vlm.py checks the tokens and positions against a real Conversation).

What the first generation (3x3 boards, nine visual tokens, dropped) taught, reused here:
- The vision tower's blocks stay frozen at their random init (trained at this size they collapse);
  only the patch merger learns, at a quarter of the rate. Its window is one cell, so a visual token
  depends on its cell's pixels only: the merger inputs of every cell content (background style,
  object, and for video the pair of frames a token spans) are computed once and looked up.
- Completions teach the lookup hop directly: part of every batch ends right after the question's
  key word, without "?" and the chat template ("What colour is the star" -> "red").
- Questions a tiny model can learn: each is a lookup (find the token of the named object, copy a
  property), none needs absolute positions (where, which image, which frame).
- Evictions in training so that missing unrelated tokens do not hurt: a share of the items hide, from
  the question on, a random part (sometimes all) of the background tokens and of the system prompt
  (never the first token), as an attention mask: exactly what a method's eviction after the media's
  prefill does. This is what makes "keep only the objects" cost nothing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kv_arena.tiny.arena_scenes import CELL, MAX_TURNS, QUESTION_TYPES, SMALL, held_out, item
from kv_arena.tiny.scene_items import Item
from kv_arena.runtime.inputs import DEFAULT_SYSTEM, QwenVLAdapter
from kv_arena.runtime.mrope_positions import model_positions
from .answer_loss import answer_loss, hidden_mask, padded
from .checkpoints import lr_at, record, resume, setup, update
from .curriculum import add_reveal_arg, hide_for_training, reveal

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sequence:
    """One training conversation as token ids, with where its visual tokens and answers sit."""

    ids: list[int]
    cells: list[tuple]  # content key of each visual token, in order (see Batcher.cell_key)
    visual_at: list[int]  # sequence index of each visual token
    answers: list[list[tuple[int, int]]]  # per turn: (index that predicts, token) for the answer and end of turn
    grids: dict  # image_grid_thw / video_grid_thw / second_per_grid_ts rows the positions are computed from
    after: int  # index of the first question token: hidden keys are hidden from here on
    system: tuple[int, int]  # the system prompt's span
    item: Item | None = None
    hidden: list[int] = field(default_factory=list)


class Batcher:
    """Turns items into batches of ids, M-RoPE positions, labels and visual tokens."""

    def __init__(self, model, adapter: QwenVLAdapter):
        self.model, self.adapter = model, adapter
        cfg = model.config
        tok = adapter.tokenizer
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id
        self.system = adapter.tokens(adapter.system_open + DEFAULT_SYSTEM + adapter.system_close)
        self.open = adapter.tokens(adapter.user_open)
        self.close = adapter.tokens(adapter.user_close + adapter.assistant_open)
        self.image_id, self.video_id = cfg.image_token_id, cfg.video_token_id
        self.start_id, self.end_id = cfg.vision_start_token_id, cfg.vision_end_token_id
        self.merger = model.model.visual.merger
        self.unit = self.merger.hidden_size // self.merger.ln_q.weight.shape[0]  # 4 patches a token
        self.table: dict[tuple, torch.Tensor] = {}  # cell content -> its merger input (unit, width)
        self._tokens: dict[str, list[int]] = {}

    def tokens(self, text: str) -> list[int]:
        if text not in self._tokens:
            self._tokens[text] = self.adapter.tokens(text)
        return self._tokens[text]

    # --- sequences -------------------------------------------------------------------------------
    def encode(self, it: Item, completion: bool = False) -> Sequence:
        """The conversation as the app feeds it; ``completion``: the first question without "?" and
        the chat template, its answer right after the key word."""
        ids = list(self.system) + list(self.open)
        cells, visual_at, grids = [], [], {}
        pictures = it.pictures
        groups = [pictures[i:i + 2] for i in range(0, len(pictures), 2)] if it.video else [[p, p] for p in pictures]
        media = [groups] if it.video else [[g] for g in groups]  # per image or video: its token groups
        for chunk in media:
            side = chunk[0][0].side
            ids.append(self.start_id)
            for a, b in chunk:
                for r in range(side):
                    for c in range(side):
                        visual_at.append(len(ids))
                        ids.append(self.video_id if it.video else self.image_id)
                        cells.append((a.background, a.things.get((r, c)), b.things.get((r, c))))
            ids.append(self.end_id)
            key = "video_grid_thw" if it.video else "image_grid_thw"
            grids.setdefault(key, []).append([len(chunk), 2 * side, 2 * side])
            if it.video:
                grids.setdefault("second_per_grid_ts", []).append(1.0)  # temporal patch 2 / 2 fps (Item.media)
        after = len(ids)
        answers = []
        for k, q in enumerate(it.turns[:1] if completion else it.turns):
            if k:
                ids += [self.eos] + self.open  # the previous answer's end of turn opens this one
            ids += self.tokens(q.text.rstrip("?")) if completion else self.tokens(q.text) + self.close
            answer = self.tokens(q.answer)
            answers.append([(len(ids) - 1 + i, t) for i, t in enumerate(answer + [self.eos])])
            ids += answer
        return Sequence(ids, cells, visual_at, answers, grids, after, (0, len(self.system)), it)

    def positions(self, seq: Sequence) -> torch.Tensor:
        types = [1 if i == self.image_id else 2 if i == self.video_id else 0 for i in seq.ids]
        grids = seq.grids.get
        return model_positions(self.model.config, types, grids("image_grid_thw", []), grids("video_grid_thw", []),
                               grids("second_per_grid_ts", []))[0]

    # --- visual tokens -------------------------------------------------------------------------
    @torch.no_grad()
    def _fill(self, keys: list[tuple]) -> None:
        """Merger inputs of new cell contents: laid out SMALL x SMALL as a two-frame video, run through
        the (frozen) tower up to the merger."""
        from kv_arena.tiny.arena_scenes import cell_pixels

        per = SMALL * SMALL
        for start in range(0, len(keys), per):
            part = keys[start:start + per]
            part = part + [part[0]] * (per - len(part))
            frames = np.zeros((2, SMALL * CELL, SMALL * CELL, 3), np.uint8)
            for i, (background, a, b) in enumerate(part):
                r, c = divmod(i, SMALL)
                frames[0, r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = cell_pixels(background, a)
                frames[1, r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = cell_pixels(background, b)
            patches, grid = self.adapter.patchify_video(frames)
            captured = []
            hook = self.merger.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach()))
            self.model.model.get_video_features(patches, torch.tensor([grid]))
            hook.remove()
            inputs = captured[0].view(per, self.unit, -1)  # window = one token: merger input in token order
            for i, key in enumerate(part):
                self.table[key] = inputs[i]

    def visuals(self, cells: list[tuple]) -> torch.Tensor:
        """(tokens, hidden) visual tokens through the merger (gradients reach it)."""
        missing = list(dict.fromkeys(k for k in cells if k not in self.table))
        if missing:
            self._fill(missing)
        pre = torch.stack([self.table[k] for k in cells])
        return self.merger(pre.reshape(-1, pre.shape[-1])).view(len(cells), -1)

    def check(self, it: Item) -> None:
        """The lookup equals running the vision tower on the item's media the app's way."""
        from kv_arena.runtime.inputs import Message

        out = self.adapter.encode_turn(Message(it.question.text, **it.media()), 0, 0, DEFAULT_SYSTEM)
        kw = out.model_kwargs
        with torch.no_grad():
            if it.video:
                f = self.model.model.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"]).pooler_output
            else:
                f = self.model.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output
            f = torch.cat(list(f)) if isinstance(f, (list, tuple)) else f
            seq = self.encode(it)
            assert torch.allclose(f, self.visuals(seq.cells), atol=1e-4), "visual tokens depend on more than their cell"
            first = seq.answers[0][0][0] + 1  # the first turn's prompt, up to the answer
            assert out.input_ids[0].tolist() == seq.ids[:first], "prompt tokens differ from the app's"
            assert torch.equal(out.rope_ids, self.positions(seq)[:, :first]), "positions differ from the app's"

    # --- batches --------------------------------------------------------------------------------
    def batch(self, seqs: list[Sequence]):
        ids, pos, labels = padded(seqs, [self.positions(s) for s in seqs], self.pad)
        return ids, pos, labels, hidden_mask(seqs, ids.shape[1])


def forward(model, batcher: Batcher, seqs: list[Sequence]):
    """Loss; per sequence and turn whether greedy decoding gets the answer and its end right; and the
    logits at every answered position (in sequence order)."""
    ids, pos, labels, mask = batcher.batch(seqs)
    embeds = model.model.get_input_embeddings()(ids)
    visual = batcher.visuals([c for s in seqs for c in s.cells]).to(embeds.dtype)
    rows = torch.tensor([i for i, s in enumerate(seqs) for _ in s.visual_at])
    cols = torch.tensor([j for s in seqs for j in s.visual_at])
    return answer_loss(model, seqs, embeds.index_put((rows, cols), visual), pos, labels, mask)


PROBES = {
    "needed_only": lambda it, rng: [k for k in range(it.visual_tokens()) if k not in set(it.question.tokens)],
    # name: which visual tokens (indices into the item's visual tokens) the first question may not see
    "objects_only": lambda it, rng: [k for k in range(it.visual_tokens()) if k not in set(it.informative)],
    "no_needed": lambda it, rng: list(it.question.tokens),
    "random75": lambda it, rng: list(rng.choice(it.visual_tokens(), size=round(0.75 * it.visual_tokens()), replace=False)),
}


@torch.no_grad()
def evaluate(model, batcher: Batcher, per_type: int) -> dict[str, float]:
    """Held-out accuracy per type on two-turn chats: ``kind`` (first question), ``kind_follow`` (the
    second, about another object), and the first question under each probe of PROBES."""
    model.eval()
    out = {}
    for kind in QUESTION_TYPES:
        items = held_out(kind, per_type, turns=2)
        runs = {"": None} | PROBES
        for name, probe in runs.items():
            rng = np.random.default_rng(0)
            turn_hits = []
            for start in range(0, len(items), 50):
                seqs = [batcher.encode(it) for it in items[start:start + 50]]
                for s in seqs:
                    if probe:
                        s.hidden = [s.visual_at[k] for k in probe(s.item, rng)]
                turn_hits += forward(model, batcher, seqs)[1]
            label = f"{kind}_{name}" if name else kind
            out[label] = float(np.mean([h[0] for h in turn_hits]))
            if not name:
                out[f"{kind}_follow"] = float(np.mean([h[1] for h in turn_hits]))
    model.train()
    return out


def draw(step: int, args) -> list[Item]:
    """The step's items: one question type per step in turn; 1 to MAX_TURNS questions per chat."""
    rng = np.random.default_rng([args.seed, step])
    kind = QUESTION_TYPES[step % len(QUESTION_TYPES)]
    return [item(args.seed * 1_000_000 + step * args.batch + i, kind, int(rng.integers(1, MAX_TURNS + 1)))
            for i in range(args.batch)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=7000, help="the schedule's length (the learning rate's cosine)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step, the schedule unchanged "
                                                            "(the shipped weights: 2750)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "tiny-arena-vl"))
    p.add_argument("--batch", type=int, default=24, help="chats per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--merger-lr-scale", type=float, default=0.25, help="the merger's rate, relative to --lr")
    p.add_argument("--completion-share", type=float, default=0.5, help="share of each batch given as completions")
    p.add_argument("--completion-until", type=int, default=1500, help="after this step, a fifth of that share")
    p.add_argument("--evict-share", type=float, default=0.5, help="chance of each kind of training eviction")
    p.add_argument("--evict-from", type=int, default=3000, help="first step with training evictions")
    add_reveal_arg(p, (500, 1500, 3000))
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-items", type=int, default=200, help="held-out chats per type")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fresh", action="store_true", help="ignore a checkpoint in --out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    model, adapter, params, optimizer = setup(args)
    start, curve, t0 = resume(model, optimizer, out, args.fresh)
    batcher = Batcher(model, adapter)
    for kind in QUESTION_TYPES:
        batcher.check(item(args.seed, kind, 2))
    model.train()
    seen_loss = []
    for step in range(start, min(args.steps, args.stop_at or args.steps)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr) * group["scale"]
        share = args.completion_share if step < args.completion_until else args.completion_share / 5
        items = draw(step, args)
        completions = round(share * len(items))
        seqs = [batcher.encode(it, completion=i < completions) for i, it in enumerate(items)]
        objects, background = reveal(step, args.reveal)
        evict = args.evict_share if step >= args.evict_from else 0.0
        rng = np.random.default_rng([args.seed, step, 1])
        for s in seqs:
            hide_for_training(s, rng, evict, objects, background)
        seen_loss.append(update(optimizer, params, forward(model, batcher, seqs)[0]))
        done = step + 1
        if done % args.eval_every == 0 or done in (args.steps, args.stop_at):
            record(model, out, curve, optimizer, done, seen_loss, t0, evaluate(model, batcher, args.eval_items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
