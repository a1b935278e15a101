"""tiny-arena-vl v3.1 (issue #57): v3 continued from its shipped weights on what visitors send.

    python -m training.train_arena_v31 --threads 1        # from assets/tiny-arena-vl, writes runs/tiny-arena-vl-v3.1

Not a new run: the model starts from ``--init`` (the bundle, stage 2's step 6,250) and counts on from
that step, so every curriculum of train_arena_v3.py stands where it ended (whole scenes in view, full
sizes, all types, the hops on); the tower stays frozen. Rerun the same command to resume from the
run's own checkpoint. What is new, mixed into v3's own chats (kept as rehearsal so its bar holds):
- ``--apart-share`` of the chats (``--apart-video-share`` of the videos) with the media prefilled
  in a part of their own and the question after (train_arena_v3.encode's ``apart``): "before the
  question", where v3 read "Which shape moves?" 0.74-0.76;
- ``--varied-share`` drawn with scene_variations.py (turned, thick, outlined, shaded, one object);
- ``--long-share`` long videos of long_videos.py (40-72 frames at 1 fps, or ``--slow-share`` of them
  spread over 5-10 minutes, as the app samples such a video), mostly apart, as streamed;
- out-of-scope chats (``--odd-share``), ``--photo-share`` of them photo-like (photo_like.py), and
  ``--subject-share`` of those one big subject.
A small rate (a tenth of v3's), a short warm-up, a cosine to a tenth of it at ``--steps``.

When the frozen tower cannot show a variation, stage 1 is continued on the variations
(train_arena_v3_eyes.py ``--varied-share``) and the run goes on with that tower, kept frozen, as v3's
stage 2 did at step 5,750: rerun once with ``--new-eyes runs/tiny-arena-vl-v3.1-eyes-2`` (done at
step 7,500: docs/offline-model.md); the curve names each point's tower. From step 8,000 the run goes
on with ``--long-share 0.12 --slow-share 0.75`` (three times the videos over minutes, which stood at
0.45-0.50 after 500 steps at 3% of the chats); each point of the curve records both shares. From
step 8,500, ``--subject-share 0.3`` of the photo-like pictures show one big coloured subject (a
tower, a vehicle, a flower: a real photo of the Eiffel tower was read as a yellow scene at step
8,000); the curve adds ``photo_subject``. Also from step 8,500, the schedule runs to 9,750
(``--steps 9750``, the rate back up from 4.7e-5 to 6.9e-5) with ``--long-share 0.16 --slow-share 0.8``:
the 10-minute videos were still at 0.50-0.65. From step 8,750 the slow videos last 1 to 10 minutes
(``--slow-minutes 1 10``): at step 8,750 a 3-minute video, never trained, was read 0.35 ("Which shape
moves?") against 0.95 over 5 minutes.

Every evaluation (``--eval-every``; also once before the first step, the bundle's own baseline)
prints and writes to training_curve.json: v3's probes (first question, follow-up, needed only, and
"unknown"), ``before_<type>`` (apart), ``varied_<type>``, ``photo``, and the long types (apart; and
``<type>_10min``, their frames over 10 minutes). When
any of v3's bar numbers falls more than ``--fall`` under its best at two evaluations in a row the
rate is halved (at most three times; the factor is kept in the curve).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kv_arena.tiny import drawn_scenes as scenes
from kv_arena.tiny.arena_model import load_arena_weights
from kv_arena.tiny.long_videos import LONG_TYPES, held_out_long, long_item
from kv_arena.tiny.photo_like import held_out_photos, photo_item
from kv_arena.tiny.scene_variations import held_out_varied, varied_item
from . import checkpoints
from . import train_arena_v3 as v3
from .checkpoints import lr_at, record, resume, update
from .curriculum import hide_for_training
from .object_loss import save_heads, setup_heads
from .train_arena_v3_eyes import load_eyes

ROOT = Path(__file__).resolve().parent.parent
V3_BAR = {"first": 0.95, "follow": 0.95, "unknown": 0.98}  # v3's held-out numbers, to hold
V31_BAR = 0.90  # the issue's: "before the question" per type and photos here; drawings by others in card_check
STAGE1 = "stage1"  # the tower v3 shipped with (training/stage1), as the curve names it


def parse_args(argv=None):
    p = v3.build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--init", default=str(ROOT / "assets" / "tiny-arena-vl"), help="the weights v3.1 starts from")
    p.add_argument("--init-step", type=int, default=6250, help="the step of --init: v3.1's steps count on from it")
    p.add_argument("--warmup", type=int, default=50, help="steps of linear warm-up from --init-step")
    p.add_argument("--apart-share", type=float, default=0.25, help="share of picture chats asked apart")
    p.add_argument("--apart-video-share", type=float, default=0.5, help="share of moving chats asked apart")
    p.add_argument("--varied-share", type=float, default=0.35, help="share of scene chats drawn with variations")
    p.add_argument("--long-share", type=float, default=0.06, help="share of chats about a long video")
    p.add_argument("--long-apart-share", type=float, default=0.75, help="share of long-video chats asked apart")
    p.add_argument("--slow-share", type=float, default=0.5,
                   help="share of long-video chats whose frames span 5-10 minutes (as the app samples such a video)")
    p.add_argument("--slow-minutes", type=float, nargs=2, default=(5.0, 10.0), metavar=("LEAST", "MOST"),
                   help="how long a --slow-share video lasts, drawn uniformly (from step 8,750: 1 to 10)")
    p.add_argument("--photo-share", type=float, default=0.5, help="share of the out-of-scope chats photo-like")
    p.add_argument("--subject-share", type=float, default=0.0,
                   help="share of the photo-like pictures showing one big coloured subject (photo_like.SUBJECT)")
    p.add_argument("--long-eval-items", type=int, default=20, help="held-out chats per long-video type")
    p.add_argument("--no-eval-first", action="store_true", help="skip the evaluation of --init before step one")
    p.set_defaults(out=str(ROOT / "runs" / "tiny-arena-vl-v3.1"), eyes=str(ROOT / "training" / "stage1"),
                   lr=2e-4, steps=9250, odd_share=0.1, eval_every=250, eval_items=40, object_warmup_until=6350)
    return p.parse_args(argv)


def lr_from(step: int, args) -> float:
    """The warm-up and cosine of checkpoints.lr_at, counted from --init-step."""
    return lr_at(step - args.init_step, args.steps - args.init_step, args.lr, args.warmup)


def draw(step: int, args, adapter) -> list[v3.Sequence]:
    """The step's chats, about --tokens tokens: v3's types in turn (some varied, some apart), long
    videos and out-of-scope pictures at their shares. Seeded by (--seed, step)."""
    rng = np.random.default_rng([args.seed, step, 31])
    seqs, total, i = [], 0, 0
    while total < args.tokens and len(seqs) < args.max_batch:
        seed = args.seed * 1_000_000 + step * 64 + i
        turns = int(rng.integers(1, scenes.MAX_TURNS + 1))
        roll, apart, completion = rng.random(), False, False
        if roll < args.odd_share:
            photo = rng.random() < args.photo_share
            it = photo_item(seed, turns, subject_share=args.subject_share) if photo else scenes.out_of_scope(seed, turns)
        elif roll < args.odd_share + args.long_share:
            minutes = float(rng.uniform(*args.slow_minutes)) if rng.random() < args.slow_share else None
            it = long_item(seed, LONG_TYPES[(step + i) % len(LONG_TYPES)], turns, minutes=minutes)
            apart = rng.random() < args.long_apart_share
        else:
            kind = scenes.QUESTION_TYPES[(step + i) % len(scenes.QUESTION_TYPES)]
            it = varied_item(seed, kind, turns) if rng.random() < args.varied_share else scenes.item(seed, kind, turns)
            apart = rng.random() < (args.apart_video_share if it.video else args.apart_share)
            completion = not apart and rng.random() < args.completion_share / 5  # v3's share after its reveal
        seqs.append(v3.encode(adapter, it, completion=completion, apart=apart))
        total += len(seqs[-1].ids)
        i += 1
    return seqs


def held_out_sets(per_type: int, long_items: int) -> dict[str, tuple[list, bool]]:
    """Every evaluation's chats (two turns each), by name: (items, asked apart)."""
    sets = {}
    for kind in scenes.QUESTION_TYPES:
        items = scenes.held_out(kind, per_type, turns=2)
        sets[kind] = (items, False)
        sets[f"before_{kind}"] = (items, True)
        sets[f"varied_{kind}"] = (held_out_varied(kind, per_type), False)
    sets["unknown"] = (scenes.held_out("unknown", per_type, turns=2), False)
    sets["photo"] = (held_out_photos(per_type), False)
    sets["photo_subject"] = (held_out_photos(per_type, subject_share=1.0), False)
    for kind in LONG_TYPES:
        sets[kind] = (held_out_long(kind, long_items), True)
        sets[f"{kind}_10min"] = (held_out_long(kind, long_items, minutes=10), True)
    return sets


@torch.no_grad()
def evaluate(model, adapter, args) -> dict[str, float]:
    """Whole-answer accuracy of every set of :func:`held_out_sets`: ``name`` (first question),
    ``name_follow`` (the second), and for v3's types ``kind_needed_only`` (v3's probe)."""
    model.eval()
    pad = adapter.tokenizer.pad_token_id
    out = {}
    for name, (items, apart) in held_out_sets(args.eval_items, args.long_eval_items).items():
        plain = name.removeprefix("before_")
        if apart and plain in out and all(_same(v3.encode(adapter, it), v3.encode(adapter, it, apart=True))
                                          for it in items[:2]):
            # pictures asked apart are the same tokens at the same positions: the numbers are the plain ones'
            out[name], out[f"{name}_follow"] = out[plain], out[f"{plain}_follow"]
            continue
        hits, alone = [], []
        for start in range(0, len(items), 8):
            part = [v3.encode(adapter, it, apart=apart) for it in items[start:start + 8]]
            hits += v3.forward(model, part, pad)[1]
            if name in scenes.QUESTION_TYPES:
                alone += v3.forward(model, [v3.needed_only(s) for s in part], pad)[1]
        out[name] = float(np.mean([h[0] for h in hits]))
        if name not in ("unknown", "photo", "photo_subject"):
            out[f"{name}_follow"] = float(np.mean([h[1] for h in hits if len(h) > 1]))
        if alone:
            out[f"{name}_needed_only"] = float(np.mean([h[0] for h in alone]))
    model.train()
    return out


def _same(a: v3.Sequence, b: v3.Sequence) -> bool:
    return a.ids == b.ids and torch.equal(a.positions, b.positions)


def bar_line(acc: dict) -> str:
    """Where the evaluation stands against v3's bar (to hold) and v3.1's (to reach: issue #57's "before
    the question" per type and photos). The varied drawings are shown, not barred: their held-out chats
    turn a fifth of the turned objects 20 to 35 degrees, past what the card promises, and the issue's bar for
    drawings is on scenes drawn by other code (``training/card_check.py --bar``)."""
    under = [f"{k} {acc[k]:.2f}" for k in scenes.QUESTION_TYPES if acc[k] < V3_BAR["first"]]
    under += [f"{k}_follow {acc[k + '_follow']:.2f}" for k in scenes.QUESTION_TYPES if acc[k + "_follow"] < V3_BAR["follow"]]
    under += [f"unknown {acc['unknown']:.2f}"] if acc["unknown"] < V3_BAR["unknown"] else []
    new = [k for k in acc if k.startswith("before_") and not k.endswith("_follow")] + ["photo"]
    short = [f"{k} {acc[k]:.2f}" for k in new if acc[k] < V31_BAR]
    varied = min(((acc[k], k) for k in acc if k.startswith("varied_") and not k.endswith("_follow")), default=None)
    shown = f"; varied drawings (shown): lowest {varied[1]} {varied[0]:.2f}" if varied else ""
    return (f"v3's bar: {'held' if not under else 'under: ' + ', '.join(under)}; "
            f"v3.1's ({V31_BAR}): {'met' if not short else 'under: ' + ', '.join(short)}{shown}")


def watched(acc: dict) -> list[str]:
    """The numbers watched for a fall: v3's bar and its needed-only probes."""
    return [k for k in acc if k.split("_")[0] in scenes.QUESTION_TYPES + ("unknown",)]


def watch(curve: list, acc: dict, step: int, args, factor: float, tower: str = STAGE1) -> float:
    """The rate's factor from now on: halved (at most three times) when a watched number has been
    more than --fall under its best since the last change (of the rate, or of the tower: a new
    tower's first evaluations are not measured against the old one's) at two evaluations in a row."""
    since = [p for p in curve if p.get("lr_factor", 1.0) == factor and p.get("tower", STAGE1) == tower]
    if factor <= 1 / 8 or not since:
        return factor

    def under(k, v, points):
        return max((p.get(k, 0.0) for p in points), default=0.0) - v > args.fall

    fell = [k for k in watched(acc) if under(k, acc[k], since) and under(k, since[-1].get(k, 1.0), since[:-1])]
    if fell:
        factor /= 2
        print(f"step {step}: {', '.join(fell)} fell by more than {args.fall} from its best; "
              f"learning rate now {factor:g} x the schedule", flush=True)
    return factor


def start(model, optimizer, args) -> tuple[int, list, float]:
    """(step, curve, start time): the run's own checkpoint if --out holds one, else --init's weights."""
    out = Path(args.out)
    if not args.fresh and (out / "optimizer.pt").exists():
        return resume(model, optimizer, out, False)
    load_arena_weights(model, Path(args.init))
    print(f"v3.1 starts from {args.init} at step {args.init_step}", flush=True)
    return args.init_step, [], time.time()


def _mix(args, factor: float, tower: str) -> dict:
    """What a curve point trained under: the rate's factor, the tower, the long-video shares (raised
    from step 8,000), the big-subject photos' (from 8,500) and where the cosine ends (--steps: 9,250,
    then 9,750 from 8,500) and how long the slow videos last (from 8,750; docs/offline-model.md)."""
    return {"lr_factor": factor, "tower": tower, "long_share": args.long_share, "slow_share": args.slow_share,
            "subject_share": args.subject_share, "steps": args.steps, "slow_minutes": list(args.slow_minutes)}


_worker: dict = {}


def _draw_in_worker(step: int, args) -> list[v3.Sequence]:
    if "adapter" not in _worker:
        torch.set_num_threads(1)
        _worker["adapter"] = checkpoints.build_v3(args.seed)[1]
    return draw(step, args, _worker["adapter"])


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    began = time.time()
    model, adapter, params, optimizer = v3.setup(args)  # the tower frozen whole (--eyes), as in v3's stage 2
    model.to(args.device)
    step0, curve, t0 = start(model, optimizer, args)
    model.to(args.device)
    factor = curve[-1].get("lr_factor", 1.0) if curve else 1.0
    tower = curve[-1].get("tower", STAGE1) if curve else STAGE1
    if args.new_eyes and curve:  # stage 1 continued (--varied-share): the run goes on with its tower
        model.model.visual.load_state_dict(load_eyes(Path(args.new_eyes))[0])
        tower = Path(args.new_eyes).name
        print(f"the tower of {args.new_eyes} replaces the run's from step {step0}", flush=True)
    pad = adapter.tokenizer.pad_token_id
    aux = v3.Auxiliary()
    if args.object_weight:
        aux.heads, aux.heads_optimizer = setup_heads(model.config.text_config.hidden_size, Path(args.eyes), out,
                                                     args.lr, args.device)
    if not curve and not args.no_eval_first:  # the bundle's own numbers on every probe: the baseline
        acc = evaluate(model, adapter, args)
        print(bar_line(acc), flush=True)
        record(model, out, curve, optimizer, step0, [], t0, {**acc, **_mix(args, factor, tower)})
        if aux.heads is not None:
            save_heads(aux.heads, aux.heads_optimizer, out)
    end = min(args.steps, args.stop_at or args.steps)
    model.train()
    seen_loss = []
    pool = concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
    ahead = {k: pool.submit(_draw_in_worker, k, args) for k in range(step0, min(end, step0 + 2 * args.workers))}
    for step in range(step0, end):
        for group in optimizer.param_groups:
            group["lr"] = lr_from(step, args) * group["scale"] * factor
        seqs = ahead.pop(step).result()
        if step + 2 * args.workers < end:
            ahead[step + 2 * args.workers] = pool.submit(_draw_in_worker, step + 2 * args.workers, args)
        rng = np.random.default_rng([args.seed, step, 1])
        for s in seqs:  # v3's rehearsal of the asked objects alone, and its training evictions
            if rng.random() < args.alone_share:
                hide_for_training(s, rng, 0.0, 1.0, 1.0)
            else:
                hide_for_training(s, rng, args.evict_share, 0.0, 0.0)
        answer, loss = v3.losses(model, seqs, pad, step, args, aux)
        update(optimizer, params, loss)
        aux.step(optimizer.param_groups[0]["lr"])
        seen_loss.append(answer.item())
        done = step + 1
        if done % 25 == 0 or done - step0 <= 3:
            print(f"step {done} loss {np.mean(seen_loss[-25:]):.4f}{aux.log()} batch {len(seqs)} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} ({(time.time() - began) / 60:.1f} min)", flush=True)
        out_of_time = args.minutes is not None and time.time() - began > 60 * args.minutes
        if done % args.eval_every == 0 or done in (args.steps, args.stop_at) or out_of_time:
            acc = evaluate(model, adapter, args)
            print(bar_line(acc), flush=True)
            factor = watch(curve, acc, done, args, factor, tower)
            record(model, out, curve, optimizer, done, seen_loss, t0, {**acc, **_mix(args, factor, tower)})
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
