"""Where v3.1 misreads the drawing variations (issue #57): held-out first questions of every varied
type, right/asked by the variation the objects the answer depends on carry, and the commonest wrong
answers beside the true ones.

    python -m training.probe_v31 runs/tiny-arena-vl-v3.1 --items 80
    python -m training.probe_v31 --tower --items 300   # what the frozen tower shows of each variation
    python -m training.probe_v31 RUN --bar --items 200  # the shipping bar and the model card's table (exit 1 below it)
    python -m training.probe_v31 RUN --over 1,3,5,10 --long-items 20  # long videos spread over those minutes

A variation that fails where the plain objects of the same chats do not is one the decoder has not
learnt to read, or one the frozen tower cannot show. ``--tower`` tells the two apart: per object of
held-out varied pictures, the shape that a stage-1 run's own read-out gives (``--eyes``; v3's was
trained on v3's drawings only), and the shape a fresh linear read-out gives after training on the
tower's output for other varied pictures (``--items`` of them). What a linear read-out can learn,
the decoder can.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

from kv_arena.runtime.vision_attention import VISION_ATTENTION_NAME
from kv_arena.tiny import arena_v3_model
from kv_arena.tiny import drawn_scenes as scenes
from kv_arena.tiny.long_videos import LONG_TYPES, held_out_long
from kv_arena.tiny.scene_variations import held_out_varied

from . import checkpoints
from . import train_arena_v3 as train
from . import train_arena_v3_eyes as eyes
from . import train_arena_v31 as v31
from .probe_v3 import load_run, named_things

TAGS = ("plain", "turned", "turned > 20°", "thick", "outlined", "shaded", "one object")


def object_tags(t) -> set[str]:
    """The variations one object carries (none: drawn as v3 draws it)."""
    return {tag for tag, on in (("turned", t.angle != 0), ("turned > 20°", abs(t.angle) > 20), ("thick", t.stroke > 1),
                                ("outlined", t.outline is not None), ("shaded", t.rgb is not None)) if on}


def tags_of(it) -> set[str]:
    """The variations the first question's named objects carry ("plain": none of them any)."""
    tags = set().union(*(object_tags(t) for t in named_things(it)))
    if sum(len(p.things) for p in it.pictures[:1 if it.video else None]) == 1:
        tags.add("one object")
    return tags or {"plain"}


@torch.no_grad()
def said(model, adapter, seqs: list) -> list[tuple[bool, str]]:
    """Per chat: whether the first answer is right (teacher forced, as the curve's), and the words
    the model puts first at each of its tokens."""
    pad = adapter.tokenizer.pad_token_id
    out = []
    for start in range(0, len(seqs), 8):
        part = seqs[start:start + 8]
        _, hits, logits = train.forward(model, part, pad, logits=True)
        tokens, k = logits.argmax(-1).tolist(), 0
        for s, h in zip(part, hits):
            n = sum(len(turn) for turn in s.answers)
            first = tokens[k:k + len(s.answers[0]) - 1]  # the answer's words, not its end of turn
            out.append((h[0], adapter.tokenizer.decode(first).strip()))
            k += n
    return out


def by_variation(model, adapter, items: int) -> dict[str, dict[str, tuple[int, int]]]:
    out = {}
    for kind in scenes.QUESTION_TYPES:
        held = held_out_varied(kind, items, turns=1)
        answers = said(model, adapter, [train.encode(adapter, it) for it in held])
        cells = {tag: [0, 0] for tag in TAGS}
        wrong = Counter()
        for it, (right, words) in zip(held, answers):
            for tag in tags_of(it):
                cells[tag][0] += right
                cells[tag][1] += 1
            if not right:
                wrong[f"{words!r} for {it.turns[0].answer!r}"] += 1
        out[kind] = {tag: tuple(c) for tag, c in cells.items()}
        line = ", ".join(f"{tag} {r}/{n}" for tag, (r, n) in out[kind].items() if n)
        right = sum(r for r, _ in answers)
        print(f"{kind} ({right}/{len(held)}): {line}", flush=True)
        for text, n in wrong.most_common(6):
            print(f"    {n} x said {text}", flush=True)
    return out


@torch.no_grad()
def shapes_read(heads, feats: list, samples: list) -> dict[str, list[int]]:
    """Per variation tag: [right, asked] of the objects' shapes (each the majority of its tokens)."""
    cells = {tag: [0, 0] for tag in TAGS}
    for s, f in zip(samples, feats):
        pred = heads(f)["shape"].argmax(-1)
        for thing, tokens, _ in s.objects:
            votes = pred[torch.tensor(tokens)].bincount(minlength=1 + len(eyes.SHAPES))[1:]
            ok = int(votes.argmax()) == eyes.SHAPES.index(thing.shape)
            for tag in (object_tags(thing) | ({"one object"} if len(s.objects) == 1 else set())) or {"plain"}:
                cells[tag][0] += ok
                cells[tag][1] += 1
    return cells


def tower(items: int, threads: int | None, folder: Path) -> dict[str, dict[str, list[int]]]:
    """The read-out of the stage-1 run in ``folder`` and a fresh linear one (trained on ``items``
    varied pictures' tower output, 300 full-batch steps) on 200 held-out varied pictures, by variation."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, _ = checkpoints.build_v3(0)
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": VISION_ATTENTION_NAME})
    visual = model.model.visual
    tower_state, head_state = eyes.load_eyes(folder)
    visual.load_state_dict(tower_state)
    visual.eval()
    stage1 = eyes.Heads(model.config.vision_config.out_hidden_size)
    stage1.load_state_dict(head_state)
    processor = arena_v3_model.image_processor()
    with torch.no_grad():
        train_set, test_set = ([eyes.still_sample(p, processor) for p in eyes.varied_pictures(n, offset)]
                               for n, offset in ((items, 20_000_000), (200, 10_000_000)))
        train_feats = [f for k in range(0, len(train_set), 16) for f in eyes.features(visual, train_set[k:k + 16])]
        test_feats = [f for k in range(0, len(test_set), 16) for f in eyes.features(visual, test_set[k:k + 16])]
    fresh = eyes.Heads(model.config.vision_config.out_hidden_size)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(300):
        loss = eyes.dense_loss(fresh, train_feats, train_set, 0.3)  # stage 1's weight
        checkpoints.update(optimizer, list(fresh.parameters()), loss)
    out = {"the run's read-out": shapes_read(stage1, test_feats, test_set),
           "a linear read-out trained on varied pictures": shapes_read(fresh, test_feats, test_set)}
    for name, cells in out.items():
        print(f"{name}: " + ", ".join(f"{tag} {r}/{n}" for tag, (r, n) in cells.items() if n), flush=True)
    return out


@torch.no_grad()
def over_minutes(model, adapter, kind: str, items: int, minutes: float) -> tuple[float, float]:
    """(first question, follow-up) right on ``items`` held-out long videos of ``kind`` spread over
    ``minutes``, asked after the video as the curve's long types are."""
    model.eval()
    held = held_out_long(kind, items, minutes=minutes)
    hits = []
    for start in range(0, len(held), 8):
        part = [train.encode(adapter, it, apart=True) for it in held[start:start + 8]]
        hits += train.forward(model, part, adapter.tokenizer.pad_token_id)[1]
    return sum(h[0] for h in hits) / len(hits), sum(h[1] for h in hits) / len(hits)


def bar(model, adapter, items: int, long_items: int) -> bool:
    """v3.1's shipping bar on ``items`` held-out two-turn chats a type (``long_items`` a long type),
    train_arena_v31.evaluate's numbers: v3's bar held (V3_BAR) and v3.1's reached (V31_BAR: before the
    question, photo-like pictures; ``bar_line`` says why the varied drawings are shown, not barred).
    Prints the model card's table; the long videos are shown, not barred (over 10 minutes their
    frames are 8 to 15 s apart: docs/offline-model.md)."""
    acc = v31.evaluate(model, adapter, argparse.Namespace(eval_items=items, long_eval_items=long_items))
    pair = lambda k: f"{acc[k]:.2f} / {acc[k + '_follow']:.2f}"  # noqa: E731
    print(f"| type | first / follow-up | only its objects in view | before the question | varied drawings |"
          f"  ({items} held-out chats a type, {long_items} a long type)")
    print("|---|---|---|---|---|")
    for kind in scenes.QUESTION_TYPES:
        print(f"| {kind} | {pair(kind)} | {acc[kind + '_needed_only']:.2f} | {pair('before_' + kind)} | "
              f"{pair('varied_' + kind)} |")
    print(f"| unknown (out-of-scope pictures) | {acc['unknown']:.2f} | | | |")
    print(f"| unknown (photo-like pictures) | {acc['photo']:.2f} | | | |")
    print(f"| unknown (photo-like, one big subject) | {acc['photo_subject']:.2f} | | | |")
    five = {kind: over_minutes(model, adapter, kind, long_items, 5.0) for kind in LONG_TYPES}
    print("\n| long video, asked after it (first / follow-up) | 40-72 s, 1 frame a second | the same frames over "
          "5 minutes | over 10 minutes |")
    print("|---|---|---|---|")
    for kind in LONG_TYPES:
        print(f"| {kind} | {pair(kind)} | {five[kind][0]:.2f} / {five[kind][1]:.2f} | {pair(kind + '_10min')} |")
    line = v31.bar_line(acc)
    print(line)
    return "under" not in line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", nargs="?", help="a v3.1 run's folder (model.safetensors, config.json)")
    p.add_argument("--items", type=int, default=80,
                   help="held-out varied chats per type; with --tower, varied pictures to train the read-out on")
    p.add_argument("--tower", action="store_true", help="instead: what the frozen tower shows of each variation")
    p.add_argument("--eyes", default=str(train.ROOT / "training" / "stage1"), help="with --tower: the stage-1 run")
    p.add_argument("--bar", action="store_true", help="instead: v3.1's shipping bar and the model card's table "
                                                      "(exits 1 below it)")
    p.add_argument("--long-items", type=int, default=40, help="with --bar or --over: held-out chats per long-video type")
    p.add_argument("--over", default=None, metavar="MINUTES",
                   help="instead: the long videos' first and follow-up answers, their frames spread over each of "
                        "these comma-separated minutes")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.tower:
        tower(args.items, args.threads, Path(args.eyes))
        return 0
    if args.run is None:
        p.error("a run's folder is needed (or --tower)")
    loaded = load_run(args.run, args.threads)
    if loaded is None:
        return 2
    if args.bar:
        return 0 if bar(*loaded, args.items, args.long_items) else 1
    if args.over:
        print(f"| minutes | {' | '.join(LONG_TYPES)} |  (first / follow-up, {args.long_items} held-out videos each)")
        print("|---|" + "---|" * len(LONG_TYPES))
        for minutes in (float(m) for m in args.over.split(",")):
            cells = [over_minutes(*loaded, kind, args.long_items, minutes) for kind in LONG_TYPES]
            print(f"| {minutes:g} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells) + " |", flush=True)
        return 0
    by_variation(*loaded, args.items)
    return 0


if __name__ == "__main__":
    sys.exit(main())
