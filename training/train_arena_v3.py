"""Train tiny-arena-vl v3 on the drawings of kv_arena/tiny/drawn_scenes.py.

    python -m training.train_arena_v3 --threads 1          # writes runs/tiny-arena-vl-v3

Seeded and resumable like v2's script: every batch is drawn from (--seed, step), and a run stopped
at any point and rerun with the same flags goes on from the last checkpoint in --out exactly as it
would have. Every --eval-every steps it prints held-out whole-answer accuracy per question type
(first question and follow-up of two-turn chats, full-size scenes) and the share of out-of-scope
pictures answered "unknown", to the log and to training_curve.json.

Unlike v2 nothing is looked up: every item goes the app's way (QwenVLAdapter.encode_turn: the
image processor, video patches, M-RoPE positions), and the vision tower sees real pixels. What
v2 taught, kept here:
- The vision tower's window is one token, so a token reads its own 28 px square (and, in a video,
  its two frames: a moving object differs between them, a still one does not); its transformer
  blocks stay at their random init (trained at this size they collapse), the patch embedding and
  the merger learn at --vision-lr-scale of the rate. The decoder puts an object together from the
  tokens of its colour (every object of an item has its own colour).
- A curriculum of what the questions see (--reveal): trained on whole prompts, v2's lookup did not
  form in 800 steps, and a first v3 run sat at chance at step 250 the same way; with only the asked
  objects visible the copy forms first, then the other objects and the background appear.
- Completions teach the lookup hop directly (--completion-share until --completion-until): part of
  every batch ends right after the first question's last word, without "?" and the chat template.
  A run with the reveal curriculum but no completions was still at chance at step 500. The log's
  ``*_needed_only`` (only the first question's objects in view) says whether the copy has formed.
- A curriculum of question types (--types-from): colour questions alone first, then the other
  one-word lookups, then pairs and lists, every batch mixing the types begun so far. With all six
  types from step 0 (one per step in turn, or mixed in every batch) runs with completions were
  still at chance at step 250 even with only the asked objects in view (``*_needed_only``); on
  colour questions alone the same recipe formed the copy by step 100.
- Evictions in training so that missing unrelated tokens do not hurt: from --evict-from on, a
  share of the items hide, from the question on, a random part (sometimes all) of the background
  tokens and of the system prompt (never its first token), as an attention mask: what a method's
  eviction after the prefill does.
- Auxiliary losses for the lookup (issue #45): with the whole scene in view the answer loss alone
  left every lookup at one object in three for 2,000 steps. --point-weight (pointer_loss.py) asks
  two heads of decoder layer 2 to attend, where each answer word is predicted, to the object the
  word names; --object-weight (object_loss.py) asks every visual token, at the input of that layer,
  to name its object's shape, colour and motion, through heads kept outside the model.
New: a size curriculum (--scale-from: pictures and videos start smaller and reach the full sizes
at --scale-until, cheaper steps while the basics are learnt), batches of about --tokens tokens,
and out-of-scope pictures (--odd-share of every batch from --odd-from on) taught to answer
"unknown". (Given from step 0, while the curriculum still hid the scenes' background, they taught a
second run that background in view means "unknown": at step 250 it answered "unknown" to everything.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kv_arena.runtime.inputs import DEFAULT_SYSTEM, Message, QwenVLAdapter
from kv_arena.tiny import drawn_scenes as scenes
from kv_arena.tiny.scene_items import Item
from . import checkpoints
from .answer_loss import answer_loss, hidden_mask, padded
from .checkpoints import lr_at, record, resume, update
from .curriculum import add_reveal_arg, hide_for_training, reveal
from .object_loss import layer_input, object_loss, object_targets, save_heads, setup_heads
from .pointer_loss import POINTER_ATTENTION, Pointing, hop_rows, naming_words, pointing, rows_of

ROOT = Path(__file__).resolve().parent.parent

@dataclass
class Sequence:
    """One training conversation: token ids, M-RoPE positions, pixels, answers."""

    ids: list[int]
    positions: torch.Tensor  # (3, L)
    pixels: dict  # the chunk's model kwargs (pixel_values, image_grid_thw, ...)
    answers: list[list[tuple[int, int]]]  # per turn: (index that predicts, token), answer and end of turn
    visual_at: list[int]  # sequence index of each visual token, in order
    after: int  # first index after the media: hidden keys are hidden from here on
    system: tuple[int, int]
    item: Item
    hidden: list[int] = field(default_factory=list)
    # per turn, the sequence index of each word of its question that names an object its answer words
    # are about (pointer_loss.naming_words), one per answer word; empty where they do not pair up
    words_at: list[list[int]] = field(default_factory=list)


def encode(adapter: QwenVLAdapter, it: Item, completion: bool = False, apart: bool = False) -> Sequence:
    """The conversation exactly as the app feeds it: the first turn with its media, each answer,
    then each follow-up turn opened by the previous answer's end-of-turn token. ``completion``: the
    first question alone, without "?" and the chat template after it, its answer right after its
    last word (v2's completions: they teach the lookup hop directly). ``apart`` (v3.1): the media
    prefilled first with the turn left open, the first question after them (Conversation.feed, then
    ask: "before the question" and a streamed video); the same tokens, but after a video the
    question's positions follow the video's last time id, which v3 never saw."""
    eos = adapter.tokenizer.eos_token_id
    text = it.turns[0].text.rstrip("?") if completion else it.turns[0].text
    first = adapter.encode_turn(Message("" if apart else text, **it.media()), 0, 0, DEFAULT_SYSTEM,
                                close_turn=not (completion or apart))
    ids = first.input_ids[0].tolist()
    pos = [first.rope_ids]
    nxt = first.next_position
    answers, words_at = [], []
    question_from = first.layout.visuals[-1].span[1]  # the first question follows its media
    for k, q in enumerate(it.turns[:1] if completion else it.turns):
        if k or apart:
            question_from = len(ids)
            chunk = (adapter.encode_turn(Message(q.text), len(ids), nxt, None, prefix_ids=[eos]) if k else
                     adapter.encode_turn(Message(q.text), len(ids), nxt, None, open_turn=False))
            ids += chunk.input_ids[0].tolist()
            pos.append(chunk.rope_ids.expand(3, -1))  # text: the three components agree
            nxt = chunk.next_position
        words_at.append(_positions_of(adapter, ids, question_from, naming_words(q)))
        answer = adapter.tokens(q.answer) + [eos]
        answers.append([(len(ids) - 1 + i, t) for i, t in enumerate(answer)])
        ids += answer[:-1]
        pos.append(torch.arange(nxt, nxt + len(answer) - 1).expand(3, -1))
        nxt += len(answer) - 1
    lay = first.layout
    visual_at = [i for v in lay.visuals for i in range(*v.span)]
    return Sequence(ids, torch.cat(pos, dim=1), first.model_kwargs, answers, visual_at,
                    lay.visuals[-1].span[1] + 1, lay.system, it, words_at=words_at)


def _positions_of(adapter: QwenVLAdapter, ids: list[int], start: int, words: list[str]) -> list[int]:
    """The index of each of ``words``, in order, in ``ids`` from ``start`` on (each after the one before)."""
    out, at = [], start
    for word in words:
        (token,) = adapter.tokens(word)
        at = ids.index(token, at)
        out.append(at)
        at += 1
    return out


def visual_features(model, seqs: list[Sequence]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every image's and every video's visual tokens, in batch order, through the vision tower."""
    inner = model.model

    def run(keys, fn):
        parts = [s.pixels for s in seqs if keys[0] in s.pixels]
        if not parts:
            return None
        kw = {k: torch.cat([p[k] for p in parts]).to(model.device) for k in keys if k in parts[0]}
        out = fn(*kw.values()).pooler_output
        return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out

    images = run(("pixel_values", "image_grid_thw"), inner.get_image_features)
    videos = run(("pixel_values_videos", "video_grid_thw"), inner.get_video_features)
    return images, videos


def forward(model, seqs: list[Sequence], pad: int, *points: Pointing, logits: bool = False):
    """Loss, and per sequence and turn whether every answer token and the end of turn is the argmax
    (teacher forced: the same as greedy decoding getting the whole answer right); with ``logits``
    also the logits at every answered position. With ``points`` (pointer_loss.py), the attention
    weights they ask for are collected on the way."""
    if points:
        with pointing(*points):
            return forward(model, seqs, pad, logits=logits)
    ids, pos, labels = (t.to(model.device) for t in padded(seqs, [s.positions for s in seqs], pad))
    mask = hidden_mask(seqs, ids.shape[1])
    cfg = model.config
    embeds = model.model.get_input_embeddings()(ids)
    images, videos = visual_features(model, seqs)
    if images is not None:
        embeds = embeds.masked_scatter((ids == cfg.image_token_id)[..., None], images.to(embeds.dtype))
    if videos is not None:
        embeds = embeds.masked_scatter((ids == cfg.video_token_id)[..., None], videos.to(embeds.dtype))
    out = answer_loss(model, seqs, embeds, pos, labels, None if mask is None else mask.to(model.device))
    return out if logits else out[:2]


@dataclass
class Auxiliary:
    """The auxiliary losses a run adds to the answers' (--point-weight and --hop-weight: pointer_loss.py,
    --object-weight: object_loss.py), with the object heads and their optimiser, and what each step's
    losses read."""

    heads: torch.nn.Module | None = None
    heads_optimizer: torch.optim.Optimizer | None = None
    on_named: list = field(default_factory=list)  # per step: the pointed heads' weight on the named tokens
    on_hops: list = field(default_factory=list)  # per step: the hops' heads' weight on what they are asked to find
    object: list = field(default_factory=list)  # per step: the object heads' loss

    def step(self, lr: float) -> None:
        """The object heads' optimiser step, at the decoder's rate, after the step's backward pass."""
        if self.heads_optimizer is not None:
            for group in self.heads_optimizer.param_groups:
                group["lr"] = lr
            self.heads_optimizer.step()
            self.heads_optimizer.zero_grad(set_to_none=True)

    def log(self) -> str:
        parts = [f" on named {np.mean(self.on_named[-25:]):.3f}"] if self.on_named else []
        parts += [" find {:.3f} relay {:.3f}".format(*np.mean(self.on_hops[-25:], axis=0))] if self.on_hops else []
        parts += [f" objects {np.mean(self.object[-25:]):.3f}"] if self.object else []
        return "".join(parts)


def losses(model, seqs: list[Sequence], pad: int, step: int, args, aux: Auxiliary):
    """(the answers' loss, the loss to minimise: the answers' plus the auxiliary losses on at ``step``)."""
    point = Pointing(args.point_layer, args.point_heads, rows_of(seqs)) \
        if args.point_weight and step >= args.point_from else None
    hops = ()
    if args.hop_weight and step >= args.hop_from:
        find, relay = hop_rows(seqs)
        hops = (Pointing(args.find_layer, args.point_heads, find), Pointing(args.relay_layer, args.point_heads, relay))
    objects = aux.heads is not None and step >= args.object_from
    with layer_input(model, args.object_layer) if objects else contextlib.nullcontext() as got:
        answer = forward(model, seqs, pad, *[p for p in (point, *hops) if p is not None])[0]
    total = answer
    if point is not None and point.log_masses:
        aux.on_named.append(point.mean_mass())
        total = total + args.point_weight * point.loss()
    if hops and hops[0].log_masses:
        aux.on_hops.append([p.mean_mass() for p in hops])
        total = total + args.hop_weight * (hops[0].loss() + hops[1].loss()) / 2
    if objects:
        # before --object-warmup-until only the heads learn (heads new to a run would push the decoder)
        hidden = got[0].detach() if step < args.object_warmup_until else got[0]
        extra = object_loss(aux.heads, hidden, seqs, [object_targets(s.item) for s in seqs])
        if extra is not None:
            aux.object.append(extra.item())
            total = total + args.object_weight * extra
    return answer, total


def scale_at(step: int, args) -> float:
    return float(min(1.0, args.scale_from + (1 - args.scale_from) * step / max(1, args.scale_until)))


def types_at(step: int, starts: dict[str, int]) -> list[str]:
    """The question types begun by ``step`` (--types-from), in QUESTION_TYPES order."""
    return [kind for kind in scenes.QUESTION_TYPES if starts[kind] <= step]


def parse_types_from(text: str) -> dict[str, int]:
    """``colour=0,shape=150,...``: every question type with its first step; one must start at 0."""
    starts = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    if sorted(starts) != sorted(scenes.QUESTION_TYPES) or min(starts.values()) != 0:
        raise argparse.ArgumentTypeError(f"give every type of {', '.join(scenes.QUESTION_TYPES)} a first step, "
                                         "one of them 0")
    return starts


def draw(step: int, args, adapter) -> list[Sequence]:
    """The step's chats: the types begun so far mixed in every batch (in turn, from a
    step-dependent start), 1 to MAX_TURNS questions each, about --tokens tokens in all; --odd-share
    of them out of scope."""
    rng = np.random.default_rng([args.seed, step])
    scale = scale_at(step, args)
    kinds = types_at(step, args.types_from)
    seqs, total, i = [], 0, 0
    while total < args.tokens and len(seqs) < args.max_batch:
        seed = args.seed * 1_000_000 + step * 64 + i
        kind = kinds[(step + i) % len(kinds)]
        turns = int(rng.integers(1, scenes.MAX_TURNS + 1))
        odd = rng.random() < args.odd_share and step >= args.odd_from
        it = scenes.out_of_scope(seed, turns, scale) if odd else scenes.item(seed, kind, turns, scale)
        share = args.completion_share if step < args.completion_until else args.completion_share / 5
        seqs.append(encode(adapter, it, completion=not odd and rng.random() < share))
        total += len(seqs[-1].ids)
        i += 1
    return seqs


_held_out: dict = {}


def encode_held_out(kind: str, per_type: int, pool) -> None:
    """Encode the held-out two-turn chats of ``kind`` once, by the worker processes of ``pool`` (eight
    chats a task), for every evaluation of this process to read: for a machine with memory to spare
    (80 chats of every type grew a CPU run to 12 GB, and a second run beside it was killed for memory)."""
    parts = [pool.submit(_encode_held_out_in_worker, kind, per_type, lo, lo + 8) for lo in range(0, per_type, 8)]
    _held_out[(kind, per_type)] = [seq for part in parts for seq in part.result()]


def held_out_batches(adapter, kind: str, per_type: int, size: int = 8):
    """The held-out two-turn chats of ``kind``, ``size`` at a time: those :func:`encode_held_out` keeps,
    else encoded batch by batch here (the same chats; only a batch's pixels are held at once)."""
    kept = _held_out.get((kind, per_type))
    if kept is not None:
        yield from (kept[start:start + size] for start in range(0, len(kept), size))
        return
    items = scenes.held_out(kind, per_type, turns=2)
    for start in range(0, len(items), size):
        yield [encode(adapter, it) for it in items[start:start + size]]


def needed_only(seq: Sequence) -> Sequence:
    """``seq`` with every visual token but the first question's objects' hidden from the questions."""
    needed = set(seq.item.question.tokens)
    return dataclasses.replace(seq, hidden=[at for k, at in enumerate(seq.visual_at) if k not in needed])


@torch.no_grad()
def evaluate(model, adapter, per_type: int) -> dict[str, float]:
    """Held-out whole-answer accuracy on two-turn chats at full size: ``kind`` (first question),
    ``kind_follow`` (the second, about another object), ``kind_needed_only`` (the first question
    seeing only its objects' visual tokens: whether the copy has formed, the curriculum's first
    stage), and ``unknown`` (out-of-scope pictures)."""
    model.eval()
    pad = adapter.tokenizer.pad_token_id
    out = {}
    for kind in scenes.QUESTION_TYPES + ("unknown",):
        hits, asked = [], []
        for part in held_out_batches(adapter, kind, per_type):
            hits += forward(model, part, pad)[1]
            if kind != "unknown":  # the curriculum's first stage: only the first question's objects in view
                asked += forward(model, [needed_only(s) for s in part], pad)[1]
        out[kind] = float(np.mean([h[0] for h in hits]))
        if kind != "unknown":
            out[f"{kind}_follow"] = float(np.mean([h[1] for h in hits]))
            out[f"{kind}_needed_only"] = float(np.mean([h[0] for h in asked]))
    model.train()
    return out


def watch_probes(curve: list, acc: dict, step: int, args, factor: float) -> float:
    """The learning rate's factor from now on: halved when a ``*_needed_only`` probe has fallen by more
    than --fall from its best since the last change at two evaluations in a row, once the reveal has
    begun (what was learnt alone is being forgotten: the first remedy of issue #45's list), at most
    three times; else unchanged.
    The factor is kept in the curve, so a resumed run goes on with it."""
    if step <= args.reveal[0] or factor <= 1 / 8:
        return factor
    since = [p for p in curve if p.get("lr_factor", 1.0) == factor]  # the points since the last change
    if not since:
        return factor

    def below_best(k, v, points):
        return max((p.get(k, 0.0) for p in points), default=0.0) - v > args.fall

    # at two evaluations in a row: a one-off dip (40-80 chats a type) recovers by itself
    fell = [k for k, v in acc.items() if k.endswith("_needed_only")
            and below_best(k, v, since) and below_best(k, since[-1].get(k, 0.0), since[:-1])]
    if fell:
        factor /= 2
        print(f"step {step}: {', '.join(fell)} fell by more than {args.fall} from its best; "
              f"learning rate now {factor:g} x the schedule", flush=True)
    return factor


def setup(args):
    """The model (seeded), its adapter, the trained parameters and their optimiser: the decoder,
    and the vision tower's patch embedding and merger at --vision-lr-scale of the rate. With
    --eyes (stage 2): the tower trained by train_arena_v3_eyes.py, loaded and frozen whole."""
    if not args.eyes:
        model, adapter, params, optimizer = checkpoints.setup(args, checkpoints.build_v3, ("merger", "patch_embed"),
                                                              args.vision_lr_scale)
    else:
        from .train_arena_v3_eyes import load_eyes

        model, adapter, params, optimizer = checkpoints.setup(args, checkpoints.build_v3, (), 0.0)
        tower, _ = load_eyes(Path(args.eyes))
        model.model.visual.load_state_dict(tower)
    model.set_attn_implementation({"text_config": POINTER_ATTENTION})  # SDPA, plus the rows --point-weight asks for
    return model, adapter, params, optimizer


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """v3's flags (train_arena_v31.py takes them with other defaults)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=7500,
                   help="the schedule's length (the learning rate's cosine; 4,000 until the run's step 4,000, "
                        "6,000 until its step 5,750)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step, the schedule unchanged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "tiny-arena-vl-v3"))
    p.add_argument("--tokens", type=int, default=6000, help="tokens per step (chats are added until reached)")
    p.add_argument("--max-batch", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vision-lr-scale", type=float, default=0.5)
    p.add_argument("--scale-from", type=float, default=0.4, help="picture size at step 0, relative to full")
    p.add_argument("--scale-until", type=int, default=1200, help="the step from which pictures are full size")
    p.add_argument("--completion-share", type=float, default=0.5, help="share of each batch given as completions")
    p.add_argument("--completion-until", type=int, default=2500,
                   help="after this step, a fifth of that share (the whole reveal: v2's proportion; a run that "
                        "cut them at 700, before the other objects were all in view, never learnt to find the named "
                        "one)")
    p.add_argument("--odd-share", type=float, default=0.08, help="share of out-of-scope chats")
    p.add_argument("--odd-from", type=int, default=2500,
                   help="first step with out-of-scope chats: once the scenes' background is in view (--reveal's C), "
                        "so that seeing background does not come to mean 'unknown'")
    p.add_argument("--evict-share", type=float, default=0.5, help="chance of each kind of training eviction")
    p.add_argument("--evict-from", type=int, default=2500, help="first step with training evictions")
    add_reveal_arg(p, (300, 1500, 2500))
    p.add_argument("--alone-share", type=float, default=0.25,
                   help="share of every batch whose questions see only their objects for the whole run: what is "
                        "learnt before the reveal is rehearsed, not forgotten")
    p.add_argument("--fall", type=float, default=0.15,
                   help="a *_needed_only probe this far under its best during the reveal halves the learning rate")
    p.add_argument("--point-weight", type=float, default=0.5,
                   help="weight of pointer_loss.py's auxiliary loss: heads that attend to the named object (0: off)")
    p.add_argument("--point-from", type=int, default=0, help="first step with the pointer loss")
    p.add_argument("--point-layer", type=int, default=2, help="the decoder layer whose heads are pointed")
    p.add_argument("--point-heads", type=lambda t: tuple(int(x) for x in t.split(",")), default=(0, 2),
                   help="the heads pointed (one per key-value head by default; the others stay free)")
    p.add_argument("--hop-weight", type=float, default=0.5,
                   help="weight of the two hops through the question's word (pointer_loss.hop_rows): heads of "
                        "--find-layer at the naming word attend to its object, heads of --relay-layer where the "
                        "answer word is predicted attend to that word (0: off)")
    p.add_argument("--hop-from", type=int, default=4000, help="first step with the hops")
    p.add_argument("--find-layer", type=int, default=0, help="the decoder layer pointed from the naming word")
    p.add_argument("--relay-layer", type=int, default=1, help="the decoder layer pointed from the answer at the word")
    p.add_argument("--object-weight", type=float, default=0.5,
                   help="weight of object_loss.py's auxiliary loss: every visual token names its object's shape, "
                        "colour and motion at the input of --object-layer (stage 2, with --eyes; 0: off)")
    p.add_argument("--object-from", type=int, default=0, help="first step with the object loss")
    p.add_argument("--object-layer", type=int, default=2, help="the decoder layer whose input the object heads read")
    p.add_argument("--object-warmup-until", type=int, default=0,
                   help="until this step the object loss trains its heads only (not the decoder)")
    p.add_argument("--types-from", type=parse_types_from,
                   default="colour=0,shape=0,images=250,moving=350,pair=500,objects=650",
                   help="TYPE=STEP,...: the step from which each question type is asked")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-items", type=int, default=40, help="held-out chats per type")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu, or cuda where an accelerator is lent (the run moves freely "
                                                   "between the two: checkpoints are read onto the CPU)")
    p.add_argument("--workers", type=int, default=1, help="processes drawing the next batches")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop, with an evaluation and a checkpoint, after this many minutes of this sitting")
    p.add_argument("--fresh", action="store_true", help="ignore a checkpoint in --out")
    p.add_argument("--eyes", default=None, help="stage 2: the folder of a train_arena_v3_eyes.py run, whose vision "
                                                "tower is loaded and frozen (a resumed run reloads its own weights)")
    p.add_argument("--new-eyes", default=None, help="a resumed run's tower replaced by this stage-1 run's (stage 1 "
                                                    "continued); saved with the run, so given once")
    return p


_worker: dict = {}


def _draw_in_worker(step: int, args) -> list[Sequence]:
    """Batches are drawn one step ahead in a worker process (its own copy of the model's position
    code and processor); what it draws depends on ``step`` only, so the run stays seeded."""
    if "adapter" not in _worker:
        torch.set_num_threads(1)
        _worker["adapter"] = checkpoints.build_v3(args.seed)[1]
    return draw(step, args, _worker["adapter"])


def _encode_held_out_in_worker(kind: str, per_type: int, lo: int, hi: int) -> list[Sequence]:
    if "adapter" not in _worker:
        torch.set_num_threads(1)
        _worker["adapter"] = checkpoints.build_v3(0)[1]
    hi = min(hi, per_type)  # the same chats as held_out(kind, per_type): seeds from its offset on
    return [encode(_worker["adapter"], it) for it in scenes.held_out(kind, hi - lo, turns=2, offset=10_000_000 + lo)]


def main(argv=None) -> int:
    import concurrent.futures
    import multiprocessing

    args = parse_args(argv)
    out = Path(args.out)
    began = time.time()
    model, adapter, params, optimizer = setup(args)
    model.to(args.device)  # before resuming: the optimiser's state follows its parameters' device
    start, curve, t0 = resume(model, optimizer, out, args.fresh)
    if args.new_eyes and start:  # stage 1 continued: the run goes on with its tower, saved with it from here
        from .train_arena_v3_eyes import load_eyes

        model.model.visual.load_state_dict(load_eyes(Path(args.new_eyes))[0])
        print(f"the tower of {args.new_eyes} replaces the run's from step {start}", flush=True)
    factor = curve[-1].get("lr_factor", 1.0) if curve else 1.0
    pad = adapter.tokenizer.pad_token_id
    model.train()
    seen_loss, aux = [], Auxiliary()
    if args.object_weight and args.eyes:  # the heads start from stage 1's
        aux.heads, aux.heads_optimizer = setup_heads(model.config.text_config.hidden_size, Path(args.eyes), out,
                                                     args.lr, args.device)
    end = min(args.steps, args.stop_at or args.steps)
    pool = concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
    if args.workers > 1:  # the held-out chats, encoded by the pool while nothing else waits for it
        for kind in scenes.QUESTION_TYPES + ("unknown",):
            encode_held_out(kind, args.eval_items, pool)
    ahead = {k: pool.submit(_draw_in_worker, k, args) for k in range(start, min(end, start + 2 * args.workers))}
    for step in range(start, end):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr) * group["scale"] * factor
        seqs = ahead.pop(step).result()
        if step + 2 * args.workers < end:
            ahead[step + 2 * args.workers] = pool.submit(_draw_in_worker, step + 2 * args.workers, args)
        rng = np.random.default_rng([args.seed, step, 1])
        evict = args.evict_share if step >= args.evict_from else 0.0
        objects, background = reveal(step, args.reveal)
        for s in seqs:
            if rng.random() < args.alone_share:  # rehearsal: only the asked objects in view
                hide_for_training(s, rng, 0.0, 1.0, 1.0)
            else:
                hide_for_training(s, rng, evict, objects, background)
        answer, loss = losses(model, seqs, pad, step, args, aux)
        update(optimizer, params, loss)
        aux.step(optimizer.param_groups[0]["lr"])
        seen_loss.append(answer.item())  # the curve's loss stays the answers' alone
        done = step + 1
        if done % 25 == 0:
            print(f"step {done} loss {np.mean(seen_loss[-25:]):.4f}{aux.log()} scale {scale_at(step, args):.2f} "
                  f"batch {len(seqs)} lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
        out_of_time = args.minutes is not None and time.time() - began > 60 * args.minutes
        if done % args.eval_every == 0 or done in (args.steps, args.stop_at) or out_of_time:
            acc = evaluate(model, adapter, args.eval_items)
            factor = watch_probes(curve, acc, done, args, factor)
            record(model, out, curve, optimizer, done, seen_loss, t0, {**acc, "lr_factor": factor})
            if aux.heads is not None:
                save_heads(aux.heads, aux.heads_optimizer, out)
        if out_of_time:
            print(f"stopped at step {done} after {args.minutes} minutes; rerun the same command to go on", flush=True)
            break
    for pending in ahead.values():
        pending.cancel()
    pool.shutdown(cancel_futures=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
