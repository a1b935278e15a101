"""Train tiny-arena-vl v1 on the seeded boards of engine/scenes.py (v2: training/train_arena_v2.py).

    python training/train_tiny_vlm.py --out assets/tiny-arena-vl

CPU is enough (about 1M parameters; the default 30,000 steps took about 105 minutes on this 2-core
CPU). Every --eval-every steps it prints held-out accuracy per question type (a learning curve, also
written to training_curve.json) and saves the weights, so an interrupted run resumes from --out with
the same flags. The prompts are built by the app's own chat adapter (system prompt, image, question,
assistant header), so training and serving see the same tokens and M-RoPE positions.

What makes it learn (each found by a run that did not):
- The vision tower's blocks stay frozen at their random init. Trained from scratch at this size
  they collapse (every visual token becomes the same large vector, which the language model uses as
  an attention sink). Only the patch merger (the MLP that maps a cell's four patches to one visual
  token) learns, at a quarter of the rate.
- Completions. "Colour of cell F?" needs two hops: the answer is predicted at the end of the
  assistant header, which must first fetch "F" from the question and then look up cell F's token.
  Trained on chat-formatted questions alone, neither hop gets a gradient until the other exists,
  and accuracy sat at chance for 2000 steps. Half of every batch therefore ends right after the
  question, without "?" and the chat template ("Colour of cell F" -> "blue"): the letter token
  itself predicts the answer, so the lookup is learnt directly (in about 600 steps), and the chat
  items then only have to copy what the letter's position already holds.
- The lookup first, then mostly counts. With count questions mixed in from the start the lookup
  was not found in 1400 steps, so the first --colour-first-steps steps ask only for colours. Counting
  is the slower skill (its errors sit at 3 to 6 cells): after the lookup phase three quarters, later
  nine tenths, of the questions are counts (with half, counts reached 52% after 4000 steps), and
  count boards vary their colour shares (engine/scenes.py) so that always answering "2" does not
  pay. Counting plateaued as the learning rate decayed (80% at 10,000 steps); each warm restart
  of --stages lifted it again.
- A position code random features can tell apart: big grey squares whose shade is the row and
  the column. Letters alone differ in a few pixels; with them as the only code, a 4x4 board's
  lookup had not formed after 1400 steps (the letters stay, for people). 4x4 boards with shade
  codes were slower than 3x3 ones too, so the boards are 3x3.
- One token per cell name (A..I). Naming a cell by row and column ("row 2, column 3") is a third
  hop (combine two digits) that did not train within 1500 steps even as a completion.
- Evictions in the last stage. Trained on whole prompts only, the model counted by something that
  also depends on the other cells: evicting one cell of another colour after the board was
  prefilled cost 7 points on counts. The last stage therefore hides, per item, one or two cells
  the answer does not depend on and a random part of the system prompt from the question and
  answer (hidden_keys: an attention mask, exactly the accuracy probe's cache edit; the curve's
  *_drop1 columns are that probe on the training path).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.arena_model import WEIGHTS, arena_image_processor, build_arena_model, tokenizer  # noqa: E402
from engine.inputs import DEFAULT_SYSTEM, Message, QwenVLAdapter  # noqa: E402
from engine.scenes import QUESTION_TYPES, held_out, sample  # noqa: E402


class Batcher:
    """Builds training batches fast, with exactly the tokens and M-RoPE positions the app feeds.

    Two facts keep a step cheap on a CPU: the prompt up to the image (system prompt, user header)
    is the same for every item, so it is run once per step and its keys/values are shared across
    the batch (gradients still flow through it); and the frozen vision blocks give each cell patch
    features that depend only on the cell (its window is the cell), so the 36 possible cells'
    merger inputs are computed once and looked up; only the (trainable) merger runs per step.
    """

    def __init__(self, model, adapter: QwenVLAdapter):
        from engine.scenes import COLOURS, GRID, Scene

        self.model, self.adapter = model, adapter
        cfg = model.config
        template = adapter.encode_turn(Message("?", images=[Scene([["red"] * GRID] * GRID).image()]), 0, 0, DEFAULT_SYSTEM)
        ids = template.input_ids[0].tolist()
        first = ids.index(cfg.image_token_id)
        self.prefix_ids = torch.tensor([ids[:first]])
        self.prefix_pos = template.rope_ids[:, :first]
        self.image_ids = ids[first:first + GRID * GRID] + [cfg.vision_end_token_id] + adapter.tokens("\n")
        self.image_pos = template.rope_ids[:, first:first + GRID * GRID + 2]
        self.text_start = int(self.image_pos[0, -1]) + 1  # position of the first question token
        self.tail = adapter.tokens(adapter.user_close + adapter.assistant_open)
        self.colours, self.grid = list(COLOURS), GRID
        merger = model.model.visual.merger
        self.merger, self.unit = merger, merger.hidden_size // merger.ln_q.weight.shape[0]  # 4 patches a token
        captured = []
        hook = merger.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach()))
        with torch.no_grad():  # one uniform board per colour: its cell (r, c) is that cell's merger input
            for colour in self.colours:
                board = Scene([[colour] * GRID for _ in range(GRID)])
                out = adapter.image_processor(images=[board.image()], return_tensors="pt")
                model.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
        hook.remove()
        # (colours, GRID*GRID, 4, width); window = one merge unit, so the merger input is in cell order
        self.cell_table = torch.stack(captured).view(len(self.colours), GRID * GRID, self.unit, -1)
        self._tokens: dict[str, list[int]] = {}

    def tokens(self, text: str) -> list[int]:
        if text not in self._tokens:
            self._tokens[text] = self.adapter.tokens(text)
        return self._tokens[text]

    def check(self, scene) -> None:
        """The lookup equals running the vision tower on the board."""
        out = self.adapter.image_processor(images=[scene.image()], return_tensors="pt")
        with torch.no_grad():
            f = self.model.model.get_image_features(out["pixel_values"], out["image_grid_thw"]).pooler_output
        f = torch.cat(list(f)) if isinstance(f, (list, tuple)) else f
        assert torch.allclose(f, self.visual(scene), atol=1e-5), "cell tokens depend on more than their cell"

    def cell_key(self, row: int, column: int) -> int:
        """The key position of a cell's visual token (0 = the first prefix token)."""
        return self.prefix_ids.shape[1] + row * self.grid + column

    def visual(self, scene) -> torch.Tensor:
        return self.visuals([scene])[0]

    def visuals(self, scenes) -> torch.Tensor:
        """(scenes, GRID*GRID, hidden) visual tokens through the merger (gradients reach it)."""
        cells = self.grid * self.grid
        idx = torch.tensor([[self.colours.index(s.colours[r][c]) for r in range(self.grid) for c in range(self.grid)]
                            for s in scenes])
        pre = self.cell_table[idx, torch.arange(cells)]  # (scenes, cells, 4, width)
        return self.merger(pre.reshape(-1, pre.shape[-1])).view(len(scenes), cells, -1)

    def batch(self, items, completions: int = 0):
        """Suffixes after the shared prefix: image, question, assistant header, answer, end of turn.
        The first ``completions`` items are completions instead: the question without its "?" and
        the chat template, the answer right after it (see the module docstring)."""
        eos = self.adapter.tokenizer.eos_token_id
        rows, width = [], 0
        for i, (scene, q) in enumerate(items):
            question = self.tokens(q.text.rstrip("?")) if i < completions else self.tokens(q.text) + self.tail
            answer = self.tokens(q.answer) + [eos]
            rows.append((scene, question, answer))
            width = max(width, len(self.image_ids) + len(question) + len(answer))
        n, v = len(items), len(self.image_ids)
        ids = torch.full((n, width), self.adapter.tokenizer.pad_token_id, dtype=torch.long)
        pos = torch.empty(3, n, width, dtype=torch.long)
        labels = torch.full((n, width), -100, dtype=torch.long)
        visual = self.visuals([scene for scene, _, _ in rows])
        text_pos = torch.arange(self.text_start, self.text_start + width - v)
        for i, (_, question, answer) in enumerate(rows):
            seq = self.image_ids + question + answer
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, v + len(question) - 1: len(seq) - 1] = torch.tensor(answer)
        pos[:, :, :v] = self.image_pos[:, None, :]
        pos[:, :, v:] = text_pos  # padding after the answer is never attended (causal)
        return ids, pos, labels, visual


def forward_loss(model, batcher: Batcher, items, completions: int = 0, hidden=None):
    """Loss and per-item hits. ``hidden[i]`` lists key positions (in the prompt, 0 = the first
    prefix token) that item ``i``'s question and answer may not see, as if a compression method
    had evicted them after the media were prefilled (the image tokens themselves still saw them)."""
    from transformers import DynamicCache

    ids, pos, labels, visual = batcher.batch(items, completions)
    inner, n = model.model, len(items)
    lm = inner.language_model
    prefix = lm(inputs_embeds=inner.get_input_embeddings()(batcher.prefix_ids),
                position_ids=batcher.prefix_pos[:, None, :], use_cache=True).past_key_values
    shared = DynamicCache()
    for i, layer in enumerate(prefix.layers):
        shared.update(layer.keys.expand(n, -1, -1, -1), layer.values.expand(n, -1, -1, -1), i)
    embeds = inner.get_input_embeddings()(ids)
    v = visual.shape[1]
    embeds = torch.cat([visual.to(embeds.dtype), embeds[:, v:]], dim=1)
    mask = None
    if hidden is not None and any(hidden):
        p, width = batcher.prefix_ids.shape[1], ids.shape[1]
        causal = torch.ones(width, p + width, dtype=torch.bool).tril(diagonal=p)
        mask = causal.expand(n, 1, width, p + width).clone()
        after = len(batcher.image_ids)  # the first question token: from here on, hidden keys are gone
        for i, keys in enumerate(hidden):
            if keys:
                mask[i, 0, after:, torch.tensor(keys)] = False
    hidden_states = lm(inputs_embeds=embeds, position_ids=pos, past_key_values=shared, attention_mask=mask,
                       use_cache=True).last_hidden_state
    answer = labels != -100
    logits = model.lm_head(hidden_states[answer])  # only where an answer token is predicted
    loss = torch.nn.functional.cross_entropy(logits, labels[answer])
    # an item is right when every answer token (and the end of turn) is the argmax: greedy agrees
    hits = torch.ones_like(labels, dtype=torch.bool)
    hits[answer] = logits.argmax(-1) == labels[answer]
    return loss, hits.all(dim=1)


def hidden_keys(batcher: Batcher, items, rng: np.random.Generator, share: float) -> list[list[int]]:
    """Evictions to train on, each item independently with probability ``share`` for each kind:
    one or two cells the answer does not depend on (the accuracy probe's "one unrelated cell": a
    count must not depend on how many other cells are left), and a random part of the system
    prompt (which the evicting methods drop first on this short prompt). The first token is never
    hidden, so the model leans on it as an attention sink; SnapKV, which can evict it, pays for
    that (README)."""
    prefix = batcher.prefix_ids.shape[1]
    out = []
    for _, question in items:
        keys = []
        others = question.unrelated_cells()
        if others and rng.random() < share:
            for i in rng.choice(len(others), size=min(len(others), int(rng.integers(1, 3))), replace=False):
                keys.append(batcher.cell_key(*others[i]))
        if rng.random() < share:
            rate = rng.random()
            keys += [k for k in range(1, prefix) if rng.random() < rate]
        out.append(keys)
    return out


def one_unrelated_cell(batcher: Batcher, items, rng: np.random.Generator) -> list[list[int]]:
    """The accuracy probe's edit (engine/bench_accuracy.py), on the training path."""
    out = []
    for _, question in items:
        others = question.unrelated_cells()
        out.append([batcher.cell_key(*others[rng.integers(len(others))])] if others else [])
    return out


@torch.no_grad()
def evaluate(model, batcher, per_type: int) -> dict[str, float]:
    """Held-out accuracy per question type: with every token, and with one unrelated cell evicted."""
    model.eval()
    out = {}
    for kind in QUESTION_TYPES:
        items = [(it.scenes[0], it.question) for it in held_out(kind, per_type)]
        drops = one_unrelated_cell(batcher, items, np.random.default_rng(0))
        for name, hidden in ((kind, None), (f"{kind}_drop1", drops)):
            right = 0
            for start in range(0, len(items), 64):
                _, ok = forward_loss(model, batcher, items[start:start + 64],
                                     hidden=hidden[start:start + 64] if hidden else None)
                right += int(ok.sum())
            out[name] = right / len(items)
    # collapse watch: mean cosine between the 36 possible visual tokens (1.0 = all the same)
    tokens = torch.nn.functional.normalize(batcher.merger(batcher.cell_table.reshape(-1, batcher.cell_table.shape[-1]))
                                           .view(-1, model.config.text_config.hidden_size), dim=-1)
    n = tokens.shape[0]
    out["visual_cos"] = round(float(((tokens @ tokens.T).sum() - n) / (n * n - n)), 3)
    model.train()
    return out


def parse_stages(text: str) -> list[tuple[int, float, float]]:
    """"END:COUNT_SHARE[:DROP_SHARE],..." -> [(end step, share of count questions, share of items
    with evictions (see hidden_keys), 0 when left out)], ends increasing."""
    try:
        stages = []
        for part in text.split(","):
            fields = part.split(":")
            if len(fields) not in (2, 3):
                raise ValueError
            stages.append((int(fields[0]), float(fields[1]), float(fields[2]) if len(fields) == 3 else 0.0))
    except ValueError:
        raise SystemExit(f"--stages: expected END:COUNT_SHARE[:DROP_SHARE],... (e.g. 10000:0.75), got {text!r}")
    ends = [stage[0] for stage in stages]
    if ends != sorted(set(ends)) or ends[0] <= 0 or not all(0 <= x <= 1 for stage in stages for x in stage[1:]):
        raise SystemExit(f"--stages: ends must increase and shares lie in [0, 1], got {text!r}")
    return stages


def stage_of(step: int, stages: list[tuple[int, float, float]]) -> tuple[int, float, float]:
    return next(stage for stage in stages if step < stage[0])


def kinds_for(step: int, args) -> list[str]:
    """The question type of each item of a step's batch: colours only while the lookup is learnt,
    then the stage's share of counts; seeded by the step, so a resumed run draws the same."""
    if step < args.colour_first_steps:
        return ["colour"] * args.batch
    draws = np.random.default_rng([args.seed, step]).random(args.batch)
    share = stage_of(step, args.stages)[1]
    return ["count" if d < share else "colour" for d in draws]


def lr_at(step: int, end: int, peak: float, warmup: int = 200) -> float:
    """Linear warm-up, then a cosine from ``peak`` down to a tenth of it at step ``end`` (the current
    stage's end: a later stage restarts where that longer cosine stands, a warm restart)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, end - warmup)))))


def save(model, out: Path, curve: list, optimizer, step: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / (WEIGHTS + ".tmp")), metadata={"step": str(step)})
    (out / (WEIGHTS + ".tmp")).replace(out / WEIGHTS)
    model.config.to_json_file(str(out / "config.json"))
    (out / "training_curve.json").write_text(json.dumps(curve, indent=1))
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, out / "optimizer.pt")


# the shipped model's schedule: the lookup, then mostly counts; counting kept improving after each
# warm restart (held-out counts 0.80 at 10000 steps, 0.86 at 16000, 0.91 at 22000); then half the
# items with evictions (0.93 at 30000, and 0.94 with one unrelated cell evicted; that was 0.84 at 22000)
STAGES = "10000:0.75,16000:0.9,22000:0.9,30000:0.9:0.5"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=parse_stages, default=parse_stages(STAGES),
                   help="END:COUNT_SHARE[:DROP_SHARE],...: train up to step END with that share of count questions "
                        "(after --colour-first-steps) and of items with evictions (hidden_keys), the learning "
                        "rate's cosine restarting at each stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "assets" / "tiny-arena-vl"))
    p.add_argument("--batch", type=int, default=48, help="questions per step (one scene each)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--merger-lr-scale", type=float, default=0.25, help="the merger's rate, relative to --lr")
    p.add_argument("--completion-share", type=float, default=0.5,
                   help="share of each batch given as completions (answer right after the question)")
    p.add_argument("--colour-first-steps", type=int, default=1000,
                   help="steps of colour-at-a-cell questions only before every type is mixed in")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-items", type=int, default=200, help="held-out questions per type")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fresh", action="store_true", help="ignore a checkpoint in --out")
    return p.parse_args(argv)


def update(optimizer, params, loss) -> float:
    """One optimiser step on ``loss`` (gradients clipped to norm 1); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return loss.detach().item()


def record(model, out: Path, curve: list, optimizer, step: int, seen_loss: list, t0: float, acc: dict) -> None:
    """A point of the learning curve (mean training loss since the last one, minutes, ``acc``):
    printed, appended to ``curve`` and saved with the checkpoint. Empties ``seen_loss``."""
    point = {"step": step, "loss": float(np.mean(seen_loss)), "minutes": round((time.time() - t0) / 60, 2),
             **{k: round(v, 3) for k, v in acc.items()}}
    curve.append(point)
    seen_loss.clear()
    print(json.dumps(point), flush=True)
    save(model, out, curve, optimizer, step)


def setup(args, version: int):
    """The model to train (seeded), its chat adapter, the trained parameters and their optimizer: the
    vision blocks frozen at their random init, the merger at ``--merger-lr-scale`` of the rate."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_arena_model(args.seed, version=version)
    model.set_attn_implementation("sdpa")
    adapter = QwenVLAdapter(model, tokenizer(version), arena_image_processor(version))
    visual = model.model.visual
    for param in visual.parameters():
        param.requires_grad_(False)
    merger = list(visual.merger.parameters())
    for param in merger:
        param.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    merger_ids = {id(p) for p in merger}
    optimizer = torch.optim.AdamW([{"params": [p for p in params if id(p) not in merger_ids], "scale": 1.0},
                                   {"params": merger, "scale": args.merger_lr_scale}], lr=args.lr, weight_decay=0.0)
    return model, adapter, params, optimizer


def resume(model, optimizer, out: Path, fresh: bool) -> tuple[int, list, float]:
    """(step, learning curve, start time) of the checkpoint in ``out``, loaded into model and optimizer;
    the start time is moved back by the minutes trained so far, so the curve counts the whole training."""
    if fresh or not (out / "optimizer.pt").exists():
        return 0, [], time.time()
    from engine.arena_model import load_arena_weights

    load_arena_weights(model, out)
    state = torch.load(out / "optimizer.pt")
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed at step {state['step']}", flush=True)
    curve = json.loads((out / "training_curve.json").read_text())
    return state["step"], curve, time.time() - 60 * (curve[-1]["minutes"] if curve else 0.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    model, adapter, params, optimizer = setup(args, version=1)
    start, curve, t0 = resume(model, optimizer, out, args.fresh)
    batcher = Batcher(model, adapter)
    batcher.check(sample(args.seed)[0])
    model.train()
    seen_loss = []
    last = args.stages[-1][0]
    for step in range(start, last):
        end, _, drop_share = stage_of(step, args.stages)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, end, args.lr) * group["scale"]
        # training seeds: step * batch + i (evaluation uses seeds from 10,000,000 up)
        items = [sample(args.seed * 1_000_000 + step * args.batch + i, kind)
                 for i, kind in enumerate(kinds_for(step, args))]
        hidden = hidden_keys(batcher, items, np.random.default_rng([args.seed, step, 1]), drop_share) if drop_share else None
        loss, _ = forward_loss(model, batcher, items, completions=round(args.completion_share * args.batch), hidden=hidden)
        seen_loss.append(update(optimizer, params, loss))
        done = step + 1
        if done % args.eval_every == 0 or done == end:
            record(model, out, curve, optimizer, done, seen_loss, t0, evaluate(model, batcher, args.eval_items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
