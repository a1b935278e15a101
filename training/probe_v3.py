"""Where a stage-2 run of tiny-arena-vl v3 stands, beyond its training curve: held-out whole-answer
accuracy of the first question in three views, and as a completion.

    python -m training.probe_v3 runs/tiny-arena-vl-v3 --items 40

Views: ``full`` (everything in view, as the app runs it), ``objects_only`` (every background token
hidden from the question: does it find the named object among the others?), ``needed_only`` (only
the asked object's tokens: can it read the object at all?), and ``completion_full`` (the question
without "?" and the chat template, the answer right after its last word, everything in view: the
lookup hop alone). When ``needed_only`` is high and ``objects_only`` sits at one over the number of
objects, the decoder reads an object but does not find the one the question names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from kv_arena.runtime.vision_attention import VISION_ATTENTION_NAME
from kv_arena.tiny.arena_model import load_arena_weights

from . import drawn_scenes as scenes
from . import train_arena_v3 as train

KINDS = ("colour", "shape", "images", "moving")


def objects_only(seq: train.Sequence) -> train.Sequence:
    """``seq`` with every visual token that is no object's hidden from the questions."""
    objects = set(seq.item.informative)
    return dataclasses.replace(seq, hidden=[at for k, at in enumerate(seq.visual_at) if k not in objects])


@torch.no_grad()
def probe(model, adapter, items: int) -> dict[str, dict[str, float]]:
    pad = adapter.tokenizer.pad_token_id
    out = {}
    for kind in KINDS:
        held = scenes.held_out(kind, items, turns=1)
        chats = [train.encode(adapter, it) for it in held]
        completions = [train.encode(adapter, it, completion=True) for it in held]
        views = {"full": chats, "objects_only": [objects_only(s) for s in chats],
                 "needed_only": [train.needed_only(s) for s in chats], "completion_full": completions}
        row = {}
        for name, seqs in views.items():
            hits = [h for start in range(0, len(seqs), 8) for h in train.forward(model, seqs[start:start + 8], pad)[1]]
            row[name] = round(float(np.mean([h[0] for h in hits])), 3)
        row["objects_per_item"] = round(float(np.mean([len({t.colour for p in s.item.pictures for t in p.things})
                                                        for s in chats])), 2)
        out[kind] = row
        print(kind, json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a stage-2 run's folder (model.safetensors, config.json)")
    p.add_argument("--items", type=int, default=40, help="held-out chats per type")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if not (Path(args.run) / "model.safetensors").is_file():
        print(f"error: no model.safetensors in {args.run}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model, adapter = train.arena_v3_model.build(0)
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": VISION_ATTENTION_NAME})  # as trained
    load_arena_weights(model, Path(args.run))
    model.eval()
    probe(model, adapter, args.items)
    return 0


if __name__ == "__main__":
    sys.exit(main())
