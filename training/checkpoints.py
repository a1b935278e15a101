"""What a training run of tiny-arena-vl needs around its model: the seeded set-up (frozen vision
blocks, the merger at a smaller rate), the learning-rate schedule, an optimiser step, and the
checkpoint it saves and resumes from (weights, optimiser, learning curve)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from kv_arena.runtime.inputs import QwenVLAdapter
from kv_arena.runtime.vision_attention import VISION_ATTENTION_NAME
from kv_arena.tiny.arena_model import WEIGHTS, build_arena_model
from kv_arena.tiny.generations import GENERATIONS, Generation


def lr_at(step: int, end: int, peak: float, warmup: int = 200) -> float:
    """Linear warm-up, then a cosine from ``peak`` down to a tenth of it at step ``end`` (the current
    stage's end: a later stage restarts where that longer cosine stands, a warm restart)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, end - warmup)))))


def build(generation: Generation, seed: int = 0) -> tuple:
    """The random-initialised model of ``generation`` (seeded) and its chat adapter."""
    model = build_arena_model(seed, generation.config())
    return model, QwenVLAdapter(model, generation.tokenizer(), generation.image_processor())


def build_v2(seed: int = 0) -> tuple:
    return build(GENERATIONS[2], seed)


def build_v3(seed: int = 0) -> tuple:
    return build(GENERATIONS[3], seed)


def setup(args, build=build_v2, vision_parts: tuple[str, ...] = ("merger",), vision_lr_scale: float | None = None):
    """The model ``build(seed)`` makes with its chat adapter (default: generation 2's), the trained
    parameters and their optimizer: the vision blocks frozen at their random init (trained at this
    size they collapse), the vision tower's ``vision_parts`` learning at ``vision_lr_scale`` of the
    rate (default ``--merger-lr-scale``), the decoder at the full rate."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, adapter = build(args.seed)
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": VISION_ATTENTION_NAME})
    visual = model.model.visual
    for param in visual.parameters():
        param.requires_grad_(False)
    vision = [param for part in vision_parts for param in getattr(visual, part).parameters()]
    for param in vision:
        param.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    vision_ids = {id(p) for p in vision}
    scale = args.merger_lr_scale if vision_lr_scale is None else vision_lr_scale
    optimizer = torch.optim.AdamW([{"params": [p for p in params if id(p) not in vision_ids], "scale": 1.0},
                                   {"params": vision, "scale": scale}], lr=args.lr, weight_decay=0.0)
    return model, adapter, params, optimizer


def update(optimizer, params, loss) -> float:
    """One optimiser step on ``loss`` (gradients clipped to norm 1); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return loss.detach().item()


def save_weights(out: Path, name: str, state: dict, curve: list, optimizer, step: int) -> None:
    """Weights ``state`` as ``name`` (written aside, then moved: an interrupted save leaves the last
    one whole), the learning curve and the optimiser state, in ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(state, str(out / (name + ".tmp")), metadata={"step": str(step)})
    (out / (name + ".tmp")).replace(out / name)
    (out / "training_curve.json").write_text(json.dumps(curve, indent=1))
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, out / "optimizer.pt")


def save(model, out: Path, curve: list, optimizer, step: int) -> None:
    """The model's weights and config (its ``arena_version`` with it), learning curve and optimiser
    state (:func:`save_weights`)."""
    save_weights(out, WEIGHTS, model.state_dict(), curve, optimizer, step)
    model.config.to_json_file(str(out / "config.json"))


def record(model, out: Path, curve: list, optimizer, step: int, seen_loss: list, t0: float, acc: dict) -> None:
    """A point of the learning curve (mean training loss since the last one, minutes, ``acc``):
    printed, appended to ``curve`` and saved with the checkpoint (loss None before any step). Empties
    ``seen_loss``."""
    point = {"step": step, "loss": float(np.mean(seen_loss)) if seen_loss else None,
             "minutes": round((time.time() - t0) / 60, 2),
             **{k: round(v, 3) if isinstance(v, float) else v for k, v in acc.items()}}  # and names (the tower)
    curve.append(point)
    seen_loss.clear()
    print(json.dumps(point), flush=True)
    save(model, out, curve, optimizer, step)


def resume(model, optimizer, out: Path, fresh: bool) -> tuple[int, list, float]:
    """(step, learning curve, start time) of the checkpoint in ``out``, loaded into model and optimizer;
    the start time is moved back by the minutes trained so far, so the curve counts the whole training."""
    if fresh or not (out / "optimizer.pt").exists():
        return 0, [], time.time()
    from kv_arena.tiny.arena_model import load_arena_weights

    load_arena_weights(model, out)
    return resume_progress(optimizer, out)


def resume_progress(optimizer, out: Path) -> tuple[int, list, float]:
    """What :func:`save_weights` wrote besides the weights, loaded: (step, learning curve, start
    time moved back by the minutes trained so far), the optimiser's state into ``optimizer``."""
    state = torch.load(out / "optimizer.pt", map_location="cpu")  # a run moves between a GPU and a CPU
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed at step {state['step']}", flush=True)
    curve = json.loads((out / "training_curve.json").read_text())
    return state["step"], curve, time.time() - 60 * (curve[-1]["minutes"] if curve else 0.0)
