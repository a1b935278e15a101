"""Accuracy benchmark: does a method keep the answers right, when, and on which turn?

    python -m kv_arena.bench --mode accuracy --per-type 200 --budgets 0.1,0.2,0.5

Held-out chats of the served tiny-arena-vl's scenes (the question types of its generation,
kv_arena/tiny/generations.py; hub models take the same questions). Each item is a two-turn chat, and
every method at every value of its knob answers it three ways:
  with      the media and the first question in one message: the method compresses that prompt
            seeing the question (what a chat does today);
  before    the media prefilled and compressed first, then the first question on the compressed
            cache (what a cached picture is: the method cannot know the question);
  follow    the second question, about *another* object, on the cache compressed "with".
An answer counts when it is the expected answer whole (lower case, punctuation dropped, exact word
for word); one that starts right and runs on past its end counts wrong, and the share of those is
reported per method. Every rate carries its 95% Wilson interval. Beside each rate, per protocol, the
method's **loyalty**: the share of items whose answer is the full cache's answer, whole (the same
normalisation; EffiVLM-Bench's headline metric): right or wrong, did the method change the answer?
The full cache's answers are kept in the JSON (``reference_answers``) so that ``--add`` measures a
new method's loyalty against the same answers. Each chat's verdict is kept too, per protocol under a
stable id (``right``: ``KIND/i``), so ``--paired A,B`` decides whether A beats B by exact McNemar
over the same chats (:mod:`.paired`). A long table runs on two cores (or machines) as two
chains of ``--add`` on copies of one run; ``--add A.json --from-json B.json`` then adds B's rows to A,
refused unless both asked the same chats.

Each point records the knob and the REALISED KV fraction: the bytes the method's cache holds after
the first prompt over the full cache's bytes after the same prompt, averaged over the items; the
figure puts it on the x axis. ``--budgets`` for methods with a budget, ``--taus`` for a method whose
knob is ZipVL's threshold ``tau``, ``--keeps`` for VisionZip's share of image tokens kept; methods
without a knob run once. A method the model's vision tower cannot serve (VisionZip on Qwen-VL, the
default tiny-arena-vl's family) is not run; the run says so and why (``refused`` in the JSON).

Three probes check the regime (full cache, media prefilled, visual KV removed by hand before the
first question): keep only the object tokens (should cost nothing), drop exactly the tokens the
answer needs (should fall to chance), drop a random 75% of the visual tokens (should cost a lot).
Prints a table; writes JSON and a Plotly figure (HTML, and PNG when kaleido and a Chrome are installed).
The committed run (``assets/accuracy``) is written only by a run that names neither ``--dataset`` nor
``--out`` (or ``--add``s to it): a data set's run goes to ``runs/accuracy-NAME`` by default, and an
``--out`` naming the committed files is refused.

``--dataset ID_OR_PATH --metric anls|vqa|relaxed|choice`` asks a public data set's items instead
(:mod:`.datasets_items`: DocVQA, TextVQA, ChartQA, MMBench, Video-MME; a ``save_to_disk`` folder or a
hub id, streamed, ``--limit`` rows), scored by its metric (:mod:`.metrics`), by the same protocols:
an item has one question, so the follow-up asks it after an opener turn the method compressed with.
No probes (they need the scenes' object tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kv_arena import backends

from ..errors import UserError
from ..paths import ASSETS, IN_CHECKOUT
from ..runtime.generate import Conversation, answer_words
from ..runtime.inputs import Message
from ..runtime.models import ARENA, load_model
from ..runtime.vision_tokens import refusal
from ..tiny import generations
from .common import REFERENCE
from .datasets_items import load_items
from .accuracy_report import PROBES, PROTOCOL_TITLES, PROTOCOLS, figure, line, markdown, table, wilson  # noqa: F401
from .metrics import METRICS
from .paired import EVERY, compare, expand, parse_pair



def parse_args(argv=None) -> argparse.Namespace:
    kinds = generations.of().scenes.QUESTION_TYPES
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=ARENA)
    p.add_argument("--methods", default="all", help="comma-separated method names, or 'all'")
    p.add_argument("--budgets", default="0.1,0.2,0.5", help="values of a method's budget")
    p.add_argument("--taus", default="0.975", help="values of a method's tau (ZipVL), when it has no budget")
    p.add_argument("--bits", default="2,4", help="values of a method's bits (KIVI), when it has no budget")
    p.add_argument("--keeps", default="0.333,0.111", help="values of a method's keep (VisionZip: the share of an "
                   "image's tokens kept; paper 192 and 64 of 576)")
    p.add_argument("--per-type", type=int, default=200, help="held-out chats per question type")
    p.add_argument("--probe-items", type=int, default=None, help="chats per type for the probes (default: --per-type)")
    p.add_argument("--types", default=",".join(kinds), help=f"question types: {', '.join(kinds)}")
    # the committed figure is rewritten in a checkout; an installed package's folder is never written
    p.add_argument("--out", default=None,
                   help="writes OUT.json, OUT.html (and OUT.png); default: the --add or --from-json run's own file, "
                        "a --dataset run's runs/accuracy-NAME, else assets/accuracy in a checkout (the committed "
                        "figure: never written by a run that names --dataset or --out)")
    p.add_argument("--no-figure", action="store_true")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="run nothing: print the tables and draw the figure of an earlier run's OUT.json; with "
                        "--add, add its methods' rows to that run (two runs --add-ed to copies of one run, e.g. "
                        "on two cores, merged)")
    p.add_argument("--add", default=None, metavar="JSON",
                   help="run only --methods on that earlier run's items (its model, types and count) and write "
                        "it back with their rows added (or replaced)")
    p.add_argument("--paired", action="append", default=[], metavar="A,B",
                   help="after the tables, test point A against point B (METHOD or METHOD@VALUE, e.g. "
                        "snapkv+fp8@0.4,snapkv@0.2; all,B: each other point against B) per protocol by exact "
                        "McNemar over the same chats: 'beats' or 'ties' at p < 0.05; repeatable; with --from-json, "
                        "on an earlier run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="draws of a method with a seed (random eviction): each point is their mean, with each draw's "
                        "rates beside it (PROTOCOL_seeds); default 1")
    p.add_argument("--json", action="store_true", help="print the report's JSON (progress and tables go to stderr)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA)")
    p.add_argument("--dataset", default=None, metavar="ID_OR_PATH",
                   help="a data set's items instead of the scenes: a save_to_disk folder or a hub id (streamed)")
    p.add_argument("--split", default=None, help="the data set's split (a hub id: default test)")
    p.add_argument("--subset", default=None, help="the hub data set's configuration, e.g. DocVQA")
    p.add_argument("--limit", type=int, default=None, help="read the first N items only")
    p.add_argument("--metric", default=None, choices=METRICS, help="how a data set's answers are scored")
    p.add_argument("--frames", type=int, default=8, help="frames sampled per video of a data set")
    args = p.parse_args(argv)
    args.out_named = args.out is not None
    if args.out is None:  # --add writes back where it read, a data set's run beside the runs: never over the committed run
        args.out = (args.add.removesuffix(".json") if args.add else args.from_json.removesuffix(".json") if args.from_json
                    else dataset_out(args.dataset) if args.dataset else str(COMMITTED) if IN_CHECKOUT else "accuracy")
    return args


COMMITTED = ASSETS / "accuracy"  # the committed run: OUT.json, .html, .png


def dataset_out(dataset: str) -> str:
    """Where a ``--dataset`` run writes by default: ``runs/accuracy-NAME`` in a checkout (git ignores
    runs/), ``accuracy-NAME`` in the working directory otherwise."""
    name = re.sub(r"[^\w.-]+", "-", Path(dataset).name if Path(dataset).is_dir() else dataset).strip("-") or "dataset"
    return str((ASSETS.parent / "runs" if IN_CHECKOUT else Path(".")) / f"accuracy-{name}")


def check_out(args) -> None:
    """A run that names ``--dataset`` or ``--out`` never writes over the committed figure
    (``assets/accuracy.json``, ``.html``, ``.png``): refused in one line before anything runs."""
    if not (args.dataset or args.out_named) or args.from_json and args.no_figure:
        return
    if Path(str(args.out)).resolve() == COMMITTED.resolve():
        raise UserError(f"--out {args.out} is the committed figure ({COMMITTED.name}.json/.html/.png): a run that names "
                        "--dataset or --out writes elsewhere; name another --out (the committed run is written by a "
                        "run without --dataset and --out, or with --add on it)")


@dataclass(frozen=True)
class Verdict:
    right: float  # the whole answer, word for word (1 or 0); a data set's metric: its score in [0, 1]
    ran_on: bool  # started with the answer and went on past it (and is not right)
    said: str = ""  # the answer as compared (its words, normalised): what loyalty compares with the full cache's


def judge(text: str, expected: str) -> Verdict:
    got, want = answer_words(text), answer_words(expected)
    return Verdict(got == want, len(got) > len(want) and got[: len(want)] == want, " ".join(got))


def loyalty(said: list[str], reference: list[str]) -> float:
    """The share of items whose answer (a :class:`Verdict`'s ``said``) is the full cache's, whole."""
    if len(said) != len(reference):
        raise ValueError(f"loyalty needs one full-cache answer per item: {len(said)} answers, {len(reference)} references")
    return sum(a == b for a, b in zip(said, reference)) / len(said) if said else 1.0


def is_right(text: str, expected: str) -> bool:
    return judge(text, expected).right


def answer_budget(expected: str) -> int:
    """New tokens for an answer: room to run on past its end, which counts wrong."""
    return 2 * len(answer_words(expected)) + 4


def verdict(q, text: str) -> Verdict:
    """A scene's question: the whole answer; a data set's (it has ``score``): its metric's score."""
    if not hasattr(q, "score"):
        return judge(text, q.answer)
    right, words = q.score(text), judge(text, q.answer)
    return Verdict(right, not right and words.ran_on, words.said)


def chat(loaded, backend, it, turns=None) -> tuple[list[Verdict], int]:
    """The item's questions (or ``turns``) asked one after another in one chat (media with the
    first); a verdict per turn, and the cache's bytes after the first prompt."""
    conv = Conversation(loaded, backend)
    verdicts, first_bytes = [], 0
    for k, q in enumerate(it.turns if turns is None else turns):
        update = conv.ask(Message(q.text, **(it.media() if k == 0 else {})), max_new_tokens=answer_budget(q.answer))
        first_bytes = first_bytes or update.metrics.kv_bytes_prefill
        verdicts.append(verdict(q, update.text))
    return verdicts, first_bytes


def asked_before(loaded, backend, it) -> Verdict:
    """The media prefilled and compressed first, then the first question on that cache."""
    conv = Conversation(loaded, backend)
    conv.feed(Message("", **it.media()))
    q = it.question
    return verdict(q, conv.ask(Message(q.text), max_new_tokens=answer_budget(q.answer)).text)


def visual_positions(layout) -> list[int]:
    """Token index of each visual token of the prompt, in the order the scenes number them."""
    return [p for v in layout.visuals for p in range(*v.span)]


def drop_visual(conv: Conversation, dropped: list[int]) -> None:
    """Remove the given visual tokens (the scenes' numbering) of the last prompt from every layer."""
    at = visual_positions(conv.layouts[-1])
    gone = torch.tensor([at[k] for k in dropped], dtype=torch.long)
    for layer in conv.cache.layers:
        layer.keep(torch.nonzero(~torch.isin(layer.positions[0], gone.to(layer.positions.device)))[:, 0])


def check_grid(loaded, it) -> None:
    """The probes remove tokens by the scene's numbering, which is the model's only where its
    processor keeps the scene's grid (tiny-arena-vl's does; a processor that rescales does not)."""
    conv = Conversation(loaded, backends.make_reference())
    conv.feed(Message("", **it.media()))
    read = len(visual_positions(conv.layouts[-1]))
    if read != it.visual_tokens():
        raise UserError(f"{loaded.spec.name} reads a {it.kind} scene as {read} visual tokens where the scene has "
                        f"{it.visual_tokens()} (its processor rescales it), so the probes cannot remove the scene's "
                        "tokens: run with --no-probe")


def probed(loaded, it, dropped: list[int]) -> bool:
    """Full cache; the media prefilled, the given visual tokens removed, then the first question."""
    conv = Conversation(loaded, backends.make_reference())
    conv.feed(Message("", **it.media()))
    drop_visual(conv, dropped)
    q = it.question
    return is_right(conv.ask(Message(q.text), max_new_tokens=answer_budget(q.answer)).text, q.answer)


def probe(loaded, items: list, rng: np.random.Generator) -> dict[str, float]:
    edits = {
        PROBES[0]: lambda it: [k for k in range(it.visual_tokens()) if k not in set(it.informative)],
        PROBES[1]: lambda it: list(it.question.tokens),
        PROBES[2]: lambda it: [int(k) for k in rng.choice(it.visual_tokens(), round(0.75 * it.visual_tokens()), replace=False)],
    }
    return {name: float(np.mean([probed(loaded, it, edit(it)) for it in items])) for name, edit in edits.items()}


def knob_of(method: str) -> str | None:
    """The knob a method's points sweep: its budget, else a ``tau``, ``bits`` or ``keep`` parameter, else none."""
    cls = backends.backend_class(method)
    if cls.uses_budget:
        return "budget"
    return next((p.name for p in cls.param_specs() if p.name in ("tau", "bits", "keep")), None)


def answers(loaded, method: str, kwargs: dict, items: list) -> tuple[dict[str, list[Verdict]], list[int]]:
    """One method at one knob value over ``items``: each protocol's verdicts, and the cache's bytes
    after each item's first prompt."""
    make = lambda: backends.make_backend(method, **kwargs)  # noqa: E731 - a fresh cache per chat
    chats = [chat(loaded, make(), it) for it in items]
    before = [asked_before(loaded, make(), it) for it in items]
    follow = [v[1] if len(v) > 1 else chat(loaded, make(), it, it.follow_turns)[0][-1] for (v, _), it in zip(chats, items)]
    return {"with": [v[0] for v, _ in chats], "before": before, "follow": follow}, [b for _, b in chats]


def point(loaded, method: str, kwargs: dict, items: list, full_bytes: list[int],
          reference: dict[str, list[str]] | None = None, ids: list[str] | None = None) -> dict:
    """One method at one knob value over ``items``: each protocol's rate, run-on share and loyalty to
    the full cache's answers ``reference`` (per protocol, one per item; None: this is the full
    cache, loyal by definition), the realised KV fraction, and each chat's verdict under its id."""
    verdicts, held = answers(loaded, method, kwargs, items)
    return scored(verdicts, held, full_bytes, reference, ids)


def chat_ids(kind: str, items: list) -> list[str]:
    """A stable id per chat: ``KIND/i``, the i-th held-out chat of the type (or the i-th item read of a
    data set); the same in every run of one model, generation and type, so two methods' verdicts pair up."""
    return [f"{kind}/{i}" for i in range(len(items))]


def scored(verdicts: dict[str, list[Verdict]], held: list[int], full_bytes: list[int],
           reference: dict[str, list[str]] | None = None, ids: list[str] | None = None) -> dict:
    """:func:`point`'s figures from the verdicts and the bytes held; with ``ids``, each chat's verdict
    per protocol (``right``: id -> right, or a data set's score) for the paired test (:mod:`.paired`)."""
    out = {"n": len(held), "realised": float(np.mean([b / f for b, f in zip(held, full_bytes)]))}
    if ids is not None:
        out["right"] = {name: {i: v.right if isinstance(v.right, bool) else float(v.right) for i, v in zip(ids, vs)}
                        for name, vs in verdicts.items()}
    for name, vs in verdicts.items():
        out[name] = float(np.mean([v.right for v in vs]))
        out[f"{name}_ran_on"] = float(np.mean([v.ran_on for v in vs]))
        said = [v.said for v in vs]
        out[f"{name}_loyalty"] = loyalty(said, reference[name] if reference is not None else said)
    return out


def said(verdicts: dict[str, list[Verdict]]) -> dict[str, list[str]]:
    """Each protocol's answers as compared (the full cache's: what every method's loyalty is measured against)."""
    return {name: [v.said for v in vs] for name, vs in verdicts.items()}


def sweep(loaded, method: str, values: dict[str, list[float]], items: list, full_bytes: list[int],
          reference: dict[str, list[str]], seeds: int = 1, ids: list[str] | None = None) -> list[dict]:
    """One point per knob value (see :func:`point`); a method with a ``seed`` (random eviction draws
    one mask per prompt shape, reading no content) is drawn ``seeds`` times and averaged (:func:`averaged`),
    so its point stands for the method, not for one draw."""
    knob = knob_of(method)
    seeded = seeds > 1 and any(p.name == "seed" for p in backends.backend_class(method).param_specs())
    out = []
    for value in values.get(knob, [None]):
        kwargs = {} if knob is None else {knob: value}
        draws = [point(loaded, method, kwargs | ({"seed": seed} if seeded else {}), items, full_bytes, reference, ids)
                 for seed in range(seeds if seeded else 1)]
        out.append({"knob": knob, "value": value} | (averaged(draws) if seeded else draws[0]))
    return out


def averaged(draws: list[dict]) -> dict:
    """Points of one method at one knob value under several seeds: every figure's mean, ``n`` the
    chats of one draw, and each protocol's rate per draw (``PROTOCOL_seeds``: their spread). A mean
    of draws is no single answer, so each draw keeps its own per-chat verdicts (``right_seeds``): the
    paired test runs once per draw."""
    out = {key: float(np.mean([d[key] for d in draws])) for key in draws[0] if key not in ("n", "right")}
    out["n"] = draws[0]["n"]
    out["seeds"] = len(draws)
    for name in PROTOCOLS:
        out[f"{name}_seeds"] = [d[name] for d in draws]
    if all("right" in d for d in draws):
        out["right_seeds"] = [d["right"] for d in draws]
    return out


def _values(text: str, name: str, high: float = 1.0, kind=float) -> list:
    try:
        values = sorted(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"--{name} must be comma-separated numbers; got {text!r}") from None
    if not values or any(not 0 < v <= high for v in values):
        raise UserError(f"--{name} must lie in (0, {high:g}]; got {text}")
    return values


def run(args) -> dict:
    values = {"budget": _values(args.budgets, "budgets"), "tau": _values(args.taus, "taus"),
              "bits": _values(args.bits, "bits", 16, int), "keep": _values(args.keeps, "keeps")}
    if args.add:  # the earlier run's items: the same model, types and count
        earlier = json.loads(Path(args.add).read_text())
        args.model, args.per_type, args.no_probe = earlier["model"], earlier["per_type"], True
        args.types = ",".join(earlier["points"])
    methods = backends.available() if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        backends.backend_class(m)
    ran = {m: [p.get("value") for p in points] for m, points in next(iter(earlier["points"].values())).items()} \
        if args.add else {REFERENCE: [None]}  # the full cache is always run
    check_pairs(getattr(args, "pairs", []), ran | {m: values.get(knob_of(m), [None]) for m in methods})
    data = dataset_items(args)  # its one "type": read before the model loads, so a bad source fails fast
    kinds = list(data) or [k.strip() for k in args.types.split(",") if k.strip()]
    generation = generations.of()  # the served one: its scenes, whichever model answers them
    scenes = generation.scenes
    for k in kinds:
        if k not in scenes.QUESTION_TYPES and k not in data:
            raise UserError(f"unknown question type '{k}'; choose from: {', '.join(scenes.QUESTION_TYPES)}")
    if args.per_type < 1:
        raise UserError(f"--per-type must be at least 1; got {args.per_type}")
    if not 1 <= args.seeds <= 100:
        raise UserError(f"--seeds must lie in [1, 100]; got {args.seeds}")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    refused = {m: refusal(loaded.model, backends.make_backend(m)) for m in methods}
    refused = {m: reason for m, reason in refused.items() if reason}  # VisionZip on a tower without a CLS token
    for m, reason in refused.items():
        print(f"{m}: not run: {reason}", flush=True)
    methods = [m for m in methods if m not in refused]
    probe_items = args.probe_items or args.per_type
    points: dict[str, dict[str, list[dict]]] = {}
    probes: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(args.seed)
    if not args.no_probe:  # before the sweeps, which take the time
        for kind in kinds:
            check_grid(loaded, scenes.held_out(kind, 1, turns=1)[0])
    earlier_answers = earlier.get("reference_answers", {}) if args.add else {}
    reference_answers: dict[str, dict[str, list[str]]] = {}
    for kind in kinds:
        items = data.get(kind) or scenes.held_out(kind, max(args.per_type, probe_items), turns=2)[: args.per_type]
        # the full cache's bytes after the first prompt: that turn alone, no follow-up to answer
        full_bytes = [chat(loaded, backends.make_reference(), it, it.turns[:1])[1] for it in items]
        ids = chat_ids(kind, items)
        points[kind] = {}
        reference = earlier_answers.get(kind)  # --add keeps the earlier run's row and its answers: not asked again
        if reference is None:  # the full cache's answers, every method's loyalty is measured against them
            verdicts, held = answers(loaded, REFERENCE, {}, items)
            reference = said(verdicts)
            if not args.add:  # an earlier run without its answers keeps its own row
                points[kind][REFERENCE] = [{"knob": None, "value": None} | scored(verdicts, held, full_bytes, ids=ids)]
                print(line(kind, REFERENCE, points[kind][REFERENCE][0]), flush=True)
        reference_answers[kind] = reference
        for method in [m for m in methods if m != REFERENCE]:
            points[kind][method] = sweep(loaded, method, values, items, full_bytes, reference, args.seeds, ids)
            for p in points[kind][method]:
                print(line(kind, method, p), flush=True)
        if not args.no_probe:
            probes[kind] = probe(loaded, scenes.held_out(kind, probe_items, turns=1), rng)
    report = {"model": args.model, "generation": generation.number, "per_type": args.per_type, "probe_items": probe_items,
              "protocols": PROTOCOL_TITLES, "scoring": "whole answer, normalised exact match",
              "x": "realised KV fraction (bytes after the first prompt / full cache's bytes)",
              "loyalty": "share of items whose answer is the full cache's answer, whole (normalised exact match)",
              "points": points, "probe": probes, "refused": refused, "reference_answers": reference_answers}
    if data:
        report |= {"per_type": len(items), "dataset": args.dataset, "split": args.split, "metric": args.metric,
                   "scoring": f"{args.metric} (kv_arena.bench.metrics), the mean score"}
    return added(earlier, report) if args.add else report


def check_pairs(pairs: list, points: dict[str, list]) -> None:
    """``--paired`` names points the run will have (``points``: each method's knob values, None for
    none): refused in one line before the run, not after it."""
    sides = [side for pair in pairs for side in pair if side.method != EVERY]
    for side in sides:
        if side.method not in points:
            raise UserError(f"--paired: {side.method} is not among the methods run ({', '.join(points)})")
    for side in sides:
        values = points[side.method]
        if side.value is None and len(values) > 1 or side.value is not None and side.value not in values:
            shown = ", ".join(f"{side.method}@{v:g}" for v in values if v is not None) or side.method
            raise UserError(f"--paired: {side} names {'more than one' if side.value is None else 'no'} point of "
                            f"this run; it will have {shown}")


def dataset_items(args) -> dict[str, list]:
    """``--dataset``'s items under its name (nothing without it); it needs ``--metric``."""
    if not args.dataset:
        if args.metric or args.limit or args.split:
            raise UserError("--metric, --limit and --split go with --dataset")
        return {}
    if not args.metric:
        raise UserError(f"--dataset needs --metric: one of {', '.join(METRICS)}")
    if args.add:
        raise UserError("--add reruns the scenes' items; with --dataset, run the data set again")
    args.no_probe = True  # the probes edit the scenes' object tokens, which a data set does not mark
    name = Path(args.dataset).name if Path(args.dataset).is_dir() else args.dataset
    return {name: load_items(args.dataset, args.metric, args.split, args.limit, args.subset, args.frames)}


def added(earlier: dict, report: dict) -> dict:
    """``earlier`` with ``report``'s methods' rows added (the full cache's stays the earlier run's)."""
    for kind, per_method in report["points"].items():
        earlier["points"][kind] |= {m: p for m, p in per_method.items() if m != REFERENCE}
    earlier["refused"] = earlier.get("refused", {}) | report["refused"]
    earlier["reference_answers"] = earlier.get("reference_answers", {}) | report["reference_answers"]
    earlier.setdefault("loyalty", report["loyalty"])
    return earlier


def merged(into: str, other: str) -> dict:
    """``other``'s methods' rows added to the run ``into``: both must have asked the same chats (the
    same model, count, and the full cache's answers to each type's chats), else refused in one line."""
    run_into, run_other = (json.loads(Path(f).read_text()) for f in (into, other))
    for key in ("model", "generation", "per_type", "reference_answers"):
        if run_into.get(key) != run_other.get(key):
            raise UserError(f"{other} did not ask the chats of {into} ({key} differs): add its methods to it with "
                            f"--add {into} --methods ...")
    return added(run_into, run_other)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.json:
        return report_main(args)
    with contextlib.redirect_stdout(sys.stderr):  # progress and tables to stderr: stdout is the JSON alone
        code = report_main(args)
    if code == 0:
        print(Path(str(args.out) + ".json").read_text() if not args.from_json or args.add
              else Path(args.from_json).read_text())
    return code


def report_main(args) -> int:
    out = Path(args.out)
    try:
        check_out(args)
        args.pairs = [parse_pair(text) for text in args.paired]
        report = (merged(args.add, args.from_json) if args.from_json and args.add
                  else json.loads(Path(args.from_json).read_text()) if args.from_json else run(args))
        if "generation" not in report:
            raise UserError(f"{args.from_json} was written by an earlier version of this benchmark (first-word "
                            "scoring, no 'before' column): run it again")
    except (UserError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(report))
    print("\n" + markdown(report))
    written = []
    if not args.from_json or args.add:
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(str(out) + ".json").write_text(json.dumps(report, indent=1))
        written.append(str(out) + ".json")
    if not args.no_figure:
        written += figure(report, out)
    print("wrote " + ", ".join(written or ["nothing"]))
    try:
        paired = [text for pair in args.pairs for a, b in expand(report, *pair) for text in compare(report, a, b)]
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if paired:
        print("\n" + "\n".join(paired))
    return 0


if __name__ == "__main__":
    sys.exit(main())
