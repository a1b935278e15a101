"""Stage 1 of tiny-arena-vl v3: teach the vision tower to see, before any question is asked.

    python -m training.train_arena_v3_eyes --threads 1     # writes runs/tiny-arena-vl-v3-eyes

Every end-to-end run of v3 left shape at chance: a loss on a few answer words is far too weak a
signal to teach a tower what a triangle is. Here the tower (patch embedding, blocks, merger) learns
alone from *dense per-token targets* computed from the drawing's geometry: for every merged token,
the shape and the colour of the object whose box holds the token's centre (or background), and in
a video whether that object moves between the token's two frames. Three linear heads read the
merger's output; the loss is the cross-entropy averaged over object tokens plus --background-weight
times the average over background tokens.

Pictures are dense (--objects per picture, any shape and colour, repeats allowed) and drawn with
every shift the scenes use (drawn_scenes.py's ``background``, ``place`` and
``_render``: off-grid positions, sizes of OBJECT_CELLS (0.6-2.2 cells for the first 6,000 steps, 1-2.2 since), textures, resizes, blur, JPEG); --video-share
of them are two-frame video clips (one temporal patch) where some objects move about a cell.

Held-out, every --eval-every steps: per object (read by the majority of its tokens) shape and
colour accuracy on the pictures of drawn_scenes' own held-out ``objects`` items and on dense held-out
pictures, by object size, and the moving object's motion bit on held-out clips; written to the log
and to training_curve.json. Seeded and resumable exactly (every batch is drawn from (--seed, step)).
Stage 2 (training/train_arena_v3.py --eyes DIR) starts from this run's tower.

v3.1 (issue #57) continues it with ``--varied-share`` of the pictures and clips drawn with
scene_variations.py's variations (turned, thick, outlined, shaded), which v3's tower shows a linear
read-out at 0.79 (turned) and 0.82 (thick) per object (``python -m training.probe_v31 --tower``);
the held-out sets then add ``varied`` (the pictures of v3.1's varied chats) and ``varied_clips``
(the commands, and what the tower shows after them: docs/offline-model.md, "Step 7,500"):

    python -m training.train_arena_v3_eyes --start-from training/stage1 --out runs/tiny-arena-vl-v3.1-eyes \
        --steps 12000 --varied-share 0.5 --video-share 0.4 --lr 5e-4 --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kv_arena.runtime.inputs import QwenVLAdapter
from kv_arena.runtime.vision_attention import VISION_ATTENTION_NAME
from kv_arena.tiny import arena_v3_model
from kv_arena.tiny import drawn_scenes as scenes
from kv_arena.tiny.scene_variations import VARIED, varied_item
from . import checkpoints

ROOT = Path(__file__).resolve().parent.parent
BACKGROUND = 0  # class 0 of each head; shapes and colours follow in drawn_scenes' order
SHAPES, COLOURS = scenes.SHAPES, tuple(scenes.COLOURS)
SIZE_BINS = ((0.0, 1.0, "under 1 cell"), (1.0, 1.5, "1-1.5 cells"), (1.5, 99.0, "1.5 cells and up"))
EYES = "eyes.safetensors"  # the tower and its heads, in --out


class Heads(torch.nn.Module):
    """Linear read-outs of the merger's output: shape, colour, motion (each with class 0 = background/still)."""

    def __init__(self, width: int):
        super().__init__()
        self.shape = torch.nn.Linear(width, 1 + len(SHAPES))
        self.colour = torch.nn.Linear(width, 1 + len(COLOURS))
        self.motion = torch.nn.Linear(width, 2)

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"shape": self.shape(features), "colour": self.colour(features), "motion": self.motion(features)}


@dataclass
class Sample:
    """One picture or clip: the tower's inputs and its per-token targets (row-major merged tokens)."""

    pixels: torch.Tensor
    grid: tuple[int, int, int]
    targets: dict[str, torch.Tensor]  # shape / colour / motion: (tokens,) class ids
    objects: list[tuple[scenes.Thing, list[int], bool]]  # each object, its tokens, whether it moves
    rows: int


# --- targets from geometry ------------------------------------------------------------------------
def holder(p: scenes.Picture, things, r: int, c: int):
    """The object whose box holds the centre of token (r, c), or None."""
    x, y = (c + 0.5) / p.cols, (r + 0.5) / p.rows
    for t in things:
        if abs(x - t.x) <= t.size / 2 * p.rows / p.cols and abs(y - t.y) <= t.size / 2:
            return t
    return None


def token_targets(p: scenes.Picture, frames: list[list[scenes.Thing]]) -> tuple[dict, list]:
    """Per-token classes for a picture whose token spans ``frames`` (one list of things each: one for
    an image, two for a clip's temporal patch), and each object's tokens (its centre-held tokens, or
    the cells its box overlaps when it holds no centre) with whether it moves."""
    n = p.rows * p.cols
    shape, colour, motion = (torch.zeros(n, dtype=torch.long) for _ in range(3))
    found: dict[tuple[str, str], list[int]] = {}
    for r in range(p.rows):
        for c in range(p.cols):
            k = r * p.cols + c
            held = [holder(p, things, r, c) for things in frames]
            t = next((h for h in held if h is not None), None)
            if t is None:
                continue
            shape[k], colour[k] = 1 + SHAPES.index(t.shape), 1 + COLOURS.index(t.colour)
            motion[k] = int(len({h for h in held}) > 1)
            found.setdefault((t.shape, t.colour), []).append(k)
    objects = []
    for t in frames[0]:
        moves = len(frames) > 1 and t not in frames[1]
        tokens = found.get((t.shape, t.colour)) or p.cells_of(t)
        objects.append((t, tokens, moves))
    return {"shape": shape, "colour": colour, "motion": motion}, objects


# --- drawing --------------------------------------------------------------------------------------
def dense_picture(rng, cells: tuple[int, int], count: tuple[int, int], vary=None) -> scenes.Picture:
    """A picture of cols x rows cells in ``cells`` with ``count`` objects of any shape and colour;
    ``vary``: v3.1's drawing variations (scene_variations.Variations), None for v3's drawings."""
    cols, rows = (int(v) for v in rng.integers(cells[0], cells[1] + 1, 2))
    p = scenes.Picture(cols, rows, (vary.background if vary else scenes.background)(rng), [],
                       scenes.rendering(rng, cols, rows))
    for _ in range(int(rng.integers(count[0], count[1] + 1))):
        t = scenes.place(rng, p, SHAPES[int(rng.integers(len(SHAPES)))], COLOURS[int(rng.integers(len(COLOURS)))],
                         tries=30)
        if t is not None:
            p.things.append(t if vary is None else vary.thing(rng, t))
    return p


def still_sample(p: scenes.Picture, processor) -> Sample:
    out = processor(images=[p.image()], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    assert (h // 2, w // 2) == (p.rows, p.cols), "the processor changed the picture's grid"
    targets, objects = token_targets(p, [p.things])
    return Sample(out["pixel_values"], (t, h, w), targets, objects, p.rows)


def clip_sample(rng, adapter: QwenVLAdapter, cells=(10, 16), count=(4, 10), vary=None) -> Sample:
    """Two video frames (one temporal patch): still objects, and one to three that move 0.6-1.3
    cells in any direction, drawn as the scenes' videos are (no resize, sometimes JPEG)."""
    p = dense_picture(rng, cells, count, vary)
    movers = set(int(i) for i in rng.choice(len(p.things), size=min(len(p.things), int(rng.integers(1, 4))),
                                            replace=False)) if p.things else set()
    second = []
    for i, t in enumerate(p.things):
        if i in movers:
            angle, step = rng.uniform(0, 2 * np.pi), rng.uniform(0.6, 1.3) / p.rows
            x = float(np.clip(t.x + step * np.cos(angle) * p.rows / p.cols, 0, 1))
            t = dataclasses.replace(t, x=x, y=float(np.clip(t.y + step * np.sin(angle), 0, 1)))
        second.append(t)
    render = {"colour_jitter": 25, "jpeg": int(rng.integers(40, 95)) if rng.random() < 0.4 else 0}
    pics = [scenes.Picture(p.cols, p.rows, p.background, things, render) for things in (p.things, second)]
    frames = np.stack([np.asarray(q.image()) for q in pics])
    patches, grid = adapter.patchify_video(frames)
    targets, objects = token_targets(p, [p.things, second])
    return Sample(patches, tuple(int(v) for v in grid), targets, objects, p.rows)


def draw_step(step: int, args, adapter, processor) -> list[Sample]:
    rng = np.random.default_rng([args.seed, step])
    out = []
    for _ in range(args.pictures):
        # no draw at all without variations: v3's runs replay batch for batch
        vary = VARIED if args.varied_share and rng.random() < args.varied_share else None
        if rng.random() < args.video_share:
            out.append(clip_sample(rng, adapter, vary=vary))
        else:
            out.append(still_sample(dense_picture(rng, tuple(args.cells), tuple(args.objects), vary), processor))
    return out


def held_out_samples(adapter, processor, count: int, varied: bool = False) -> dict[str, list[Sample]]:
    """The evaluation sets: the pictures of drawn_scenes' held-out ``objects`` items (the scenes the
    questions are asked about), dense pictures and clips from seeds no training step draws; with
    ``varied``, the pictures of v3.1's held-out varied chats of every picture type and varied clips."""
    items = scenes.held_out("objects", count)
    scene_pictures = [still_sample(p, processor) for it in items for p in it.pictures]
    rng = np.random.default_rng([10_000_000, 7])
    dense = [still_sample(dense_picture(rng, (14, 24), (8, 20)), processor) for _ in range(count // 3)]
    clips = [clip_sample(rng, adapter) for _ in range(count // 3)]
    sets = {"scenes": scene_pictures, "dense": dense, "clips": clips}
    if varied:
        sets["varied"] = [still_sample(p, processor) for p in varied_pictures(count, 10_000_000)]
        sets["varied_clips"] = [clip_sample(rng, adapter, vary=VARIED) for _ in range(count // 3)]
    return sets


def varied_pictures(count: int, offset: int) -> list[scenes.Picture]:
    """The pictures of ``count`` v3.1 varied chats (one turn), the picture types in turn, from seed ``offset``."""
    kinds = [k for k in scenes.QUESTION_TYPES if k != "moving"]
    return [p for i in range(count) for p in varied_item(offset + i, kinds[i % len(kinds)]).pictures]


# --- training -------------------------------------------------------------------------------------
def features(visual, samples: list[Sample]) -> list[torch.Tensor]:
    """The merger's output per sample (one tower call for the batch)."""
    pixels = torch.cat([s.pixels for s in samples])
    grid = torch.tensor([s.grid for s in samples])
    out = visual(pixels, grid_thw=grid).pooler_output
    sizes = [s.grid[0] * s.grid[1] * s.grid[2] // 4 for s in samples]
    return list(out.split(sizes))


def dense_loss(heads: Heads, feats: list[torch.Tensor], samples: list[Sample], background_weight: float):
    """Cross-entropy of each head averaged over object tokens, plus ``background_weight`` times its
    average over background tokens (background dominates a picture; unweighted it drowns the shapes)."""
    x = torch.cat(feats)
    logits = heads(x)
    total = 0.0
    on = torch.cat([s.targets["colour"] for s in samples]) != BACKGROUND
    for name, out in logits.items():
        target = torch.cat([s.targets[name] for s in samples])
        each = F.cross_entropy(out, target, reduction="none")
        total = total + (each[on].mean() if on.any() else 0.0) + background_weight * each[~on].mean()
    return total


@torch.no_grad()
def evaluate(visual, heads: Heads, sets: dict[str, list[Sample]]) -> dict[str, float]:
    """Per-object accuracy: an object's shape and colour are the majority vote of its tokens; by
    size bin on the scenes' pictures; on clips, whether the moving objects' tokens say 'moves'."""
    visual.eval()
    out = {}
    for name, samples in sets.items():
        right = {"shape": [], "colour": [], "motion": []}
        by_size = {label: [] for *_, label in SIZE_BINS}
        for start in range(0, len(samples), 4):
            part = samples[start:start + 4]
            for s, f in zip(part, features(visual, part)):
                pred = {k: v.argmax(-1) for k, v in heads(f).items()}
                for thing, tokens, moves in s.objects:
                    at = torch.tensor(tokens)
                    shape = int(pred["shape"][at].bincount(minlength=1 + len(SHAPES))[1:].argmax()) + 1
                    colour = int(pred["colour"][at].bincount(minlength=1 + len(COLOURS))[1:].argmax()) + 1
                    ok_shape = shape == 1 + SHAPES.index(thing.shape)
                    right["shape"].append(ok_shape)
                    right["colour"].append(colour == 1 + COLOURS.index(thing.colour))
                    if name.endswith("clips"):
                        right["motion"].append(bool(pred["motion"][at].float().mean() > 0.5) == moves)
                    cells = thing.size * s.rows
                    by_size[next(label for lo, hi, label in SIZE_BINS if lo <= cells < hi)].append(ok_shape)
        for k, v in right.items():
            if v:
                out[f"{name}_{k}"] = float(np.mean(v))
        if name == "scenes":
            for label, v in by_size.items():
                out[f"shape {label}"] = f"{sum(v)}/{len(v)}"
    visual.train()
    return out


def build(args):
    """The seeded v3 model's vision tower (trained whole) and the heads."""
    torch.manual_seed(args.seed)
    model, adapter = checkpoints.build_v3(args.seed)
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": VISION_ATTENTION_NAME})
    visual = model.model.visual
    heads = Heads(model.config.vision_config.out_hidden_size)
    return visual, heads, adapter


def state_of(visual, heads) -> dict[str, torch.Tensor]:
    return ({f"visual.{k}": v for k, v in visual.state_dict().items()}
            | {f"heads.{k}": v for k, v in heads.state_dict().items()})


def load_eyes(directory: Path) -> tuple[dict, dict]:
    """(tower state, heads state) saved by this script in ``directory``: what stage 2 starts from."""
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / EYES))
    split = {"visual.": {}, "heads.": {}}
    for k, v in state.items():
        prefix = "visual." if k.startswith("visual.") else "heads."
        split[prefix][k[len(prefix):]] = v
    return split["visual."], split["heads."]


def save(out: Path, visual, heads, optimizer, step: int, curve: list) -> None:
    checkpoints.save_weights(out, EYES, state_of(visual, heads), curve, optimizer, step)


def resume(out: Path, visual, heads, optimizer, fresh: bool, start_from: str | None = None) -> tuple[int, list, float]:
    """(step, curve, start time) of the run in ``out``; a new run starts at step 0, or, with
    ``start_from`` (a finished run's folder, e.g. training/stage1), from its tower, heads, curve and
    last step, with a fresh optimiser: stage 1 continued with another mix (--video-share)."""
    if fresh or not (out / "optimizer.pt").exists():
        if not start_from:
            return 0, [], time.time()
        tower, head = load_eyes(Path(start_from))
        visual.load_state_dict(tower)
        heads.load_state_dict(head)
        curve = json.loads((Path(start_from) / "training_curve.json").read_text())
        print(f"continuing {start_from} from step {curve[-1]['step']}", flush=True)
        return curve[-1]["step"], curve, time.time() - 60 * curve[-1]["minutes"]
    tower, head = load_eyes(out)
    visual.load_state_dict(tower)
    heads.load_state_dict(head)
    return checkpoints.resume_progress(optimizer, out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "tiny-arena-vl-v3-eyes"))
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW, constant")
    p.add_argument("--pictures", type=int, default=2, help="pictures (or clips) per step")
    p.add_argument("--cells", type=int, nargs=2, default=(14, 24), help="a picture's side in cells, low high")
    p.add_argument("--objects", type=int, nargs=2, default=(8, 20), help="objects per picture, low high")
    p.add_argument("--video-share", type=float, default=0.25, help="share of two-frame clips")
    p.add_argument("--varied-share", type=float, default=0.0,
                   help="share of pictures and clips drawn with v3.1's variations (scene_variations.py)")
    p.add_argument("--background-weight", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--eval-items", type=int, default=60,
                   help="held-out objects items (and a third as many dense pictures and clips)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fresh", action="store_true", help="ignore a checkpoint in --out")
    p.add_argument("--start-from", default=None,
                   help="a new run in --out continues this finished run (its tower, heads, curve and step)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    visual, heads, adapter = build(args)
    processor = arena_v3_model.image_processor()
    params = list(visual.parameters()) + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    start, curve, t0 = resume(out, visual, heads, optimizer, args.fresh, args.start_from)
    sets = held_out_samples(adapter, processor, args.eval_items, varied=args.varied_share > 0)
    visual.train()
    seen = []
    end = min(args.steps, args.stop_at or args.steps)
    if start >= end:  # nothing left to train: read the tower on today's held-out sets
        print(json.dumps({"step": start, **evaluate(visual, heads, sets)}), flush=True)
        return 0
    for step in range(start, end):
        samples = draw_step(step, args, adapter, processor)
        loss = dense_loss(heads, features(visual, samples), samples, args.background_weight)
        seen.append(checkpoints.update(optimizer, params, loss))
        done = step + 1
        if done % 50 == 0:
            print(f"step {done} loss {np.mean(seen[-50:]):.4f}", flush=True)
        if done % args.eval_every == 0 or done == end:
            point = {"step": done, "loss": float(np.mean(seen)) if seen else None,
                     "minutes": round((time.time() - t0) / 60, 2), **evaluate(visual, heads, sets)}
            seen.clear()
            curve.append(point)
            print(json.dumps(point), flush=True)
            save(out, visual, heads, optimizer, done, curve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
