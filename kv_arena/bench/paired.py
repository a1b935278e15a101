"""Two methods' answers to the same chats, compared chat by chat: exact McNemar.

Every method of an accuracy run answers the same chats, so whether A beats B is decided by the
chats where they disagree, not by whether two intervals drawn as if from independent samples
overlap. Under "neither is better" each such chat is a fair coin: the two-sided exact binomial
test on the discordant pairs (McNemar's exact test). ``--paired A,B`` prints it per protocol
from a run's per-chat verdicts (:func:`.accuracy.scored`'s ``right``); against a method drawn with
several seeds (random eviction), once per draw.
"""

from __future__ import annotations

from collections import Counter
from math import comb
from typing import NamedTuple

from ..errors import UserError
from .accuracy_report import PROTOCOLS

LEVEL = 0.05  # "beats" below it, "ties" at or above
TEST = "exact McNemar"
EVERY = "all"  # --paired all,B: each other point of the run against B
COLUMNS = {"with": "with the question", "before": "before the question", "follow": "follow-up"}


class McNemar(NamedTuple):
    b_only: int  # chats B answered right and A wrong
    a_only: int  # chats A answered right and B wrong
    p_value: float  # two-sided exact binomial test of the discordant chats against a fair coin


def mcnemar(a: list[bool], b: list[bool]) -> McNemar:
    """Exact two-sided McNemar test of two methods' verdicts on the same chats (``a[i]``, ``b[i]``:
    chat i answered right). p = P(a fair coin's split of the discordant chats is at least as uneven),
    in exact integers, 1 when there is no discordant chat."""
    if len(a) != len(b):
        raise ValueError(f"mcnemar pairs verdicts on the same chats: {len(a)} against {len(b)}")
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    n, low = a_only + b_only, min(a_only, b_only)
    tail = sum(comb(n, k) for k in range(low + 1))  # P(X <= low) * 2**n, X ~ Binomial(n, 1/2)
    return McNemar(b_only, a_only, min(1.0, 2 * tail / 2**n))


class Side(NamedTuple):
    """One side of a pair: a method and, where it ran at several, its knob's value."""

    method: str
    value: float | None

    def __str__(self) -> str:
        return self.method if self.value is None else f"{self.method}@{self.value:g}"


def parse_pair(text: str) -> tuple[Side, Side]:
    """``A,B``, each ``METHOD`` or ``METHOD@VALUE`` (its budget, tau, bits or keep), e.g. ``snapkv+fp8@0.4,snapkv@0.2``;
    A may be ``all`` (:func:`expand`)."""
    sides = [s.strip() for s in text.split(",")]
    if len(sides) != 2 or not all(sides):
        raise UserError(f"--paired takes two points, A,B (METHOD or METHOD@VALUE, e.g. snapkv+fp8@0.4,snapkv@0.2); "
                        f"got {text!r}")
    out = []
    for side in sides:
        method, _, value = side.partition("@")
        try:
            out.append(Side(method.strip(), float(value) if value else None))
        except ValueError:
            raise UserError(f"--paired: {side!r}'s knob value must be a number (METHOD@VALUE)") from None
    if out[0] == out[1]:
        raise UserError(f"--paired compares two different points; got {text!r}")
    if out[1].method == EVERY or out[0].method == EVERY and out[0].value is not None:
        raise UserError(f"--paired: '{EVERY}' stands first and alone (all,B: each other point against B); got {text!r}")
    return out[0], out[1]


def expand(report: dict, a: Side, b: Side) -> list[tuple[Side, Side]]:
    """The pairs ``A,B`` names: itself, or for ``all,B`` each other point of the run against B, in the
    run's order (a method at several values once per value)."""
    if a.method != EVERY:
        return [(a, b)]
    own = _points(report, b)[0]  # B names a point of the run, or one line says what the run has
    rows = next(iter(report["points"].values()))
    return [(Side(method, p.get("value") if len(points) > 1 else None), b)
            for method, points in rows.items() for p in points if p is not own]


def _points(report: dict, side: Side) -> list[dict]:
    """``side``'s point in each type of the run, or a one-line refusal naming what the run has."""
    found = []
    for kind, per_method in report["points"].items():
        rows = per_method.get(side.method)
        if rows is None:
            raise UserError(f"--paired: {side.method} is not in this run; it has {', '.join(per_method)}")
        chosen = [p for p in rows if side.value is None or p.get("value") is not None
                  and abs(p["value"] - side.value) < 1e-9]
        if len(chosen) != 1:
            ran = ", ".join(f"{side.method}@{p['value']:g}" for p in rows if p.get("value") is not None) or side.method
            raise UserError(f"--paired: {side} names {'no' if not chosen else 'more than one'} point of this run; "
                            f"it has {ran}")
        found.append(chosen[0])
    return found


def _draws(report: dict, side: Side, protocol: str) -> list[dict[str, bool]]:
    """``side``'s per-chat verdicts under ``protocol``, by chat id over every type: one dict, or one
    per draw for a point averaged over seeds (``right_seeds``)."""
    out: list[dict[str, bool]] = []
    for p in _points(report, side):
        draws = p.get("right_seeds") or ([p["right"]] if "right" in p else None)
        if draws is None:
            why = ("averaged over seeds before each draw's verdicts were kept" if p.get("seeds") else
                   "written before per-chat verdicts were recorded")
            raise UserError(f"paired test unavailable: {side} has no per-chat verdicts ({why}): run it again")
        out += [{} for _ in range(len(draws) - len(out))]
        for merged, draw in zip(out, draws):
            for chat, right in draw[protocol].items():
                if right not in (0, 1):
                    raise UserError(f"paired test unavailable: it counts right and wrong answers, and {side} scored "
                                    f"{chat} {right:g} (the data set's metric lies between)")
                merged[chat] = bool(right)
    return out


def _span(values: list, form: str = "{}") -> str:
    """The lowest and highest of the draws' figures, ``3 to 7``; one figure where they agree."""
    low, high = form.format(min(values)), form.format(max(values))
    return low if low == high else f"{low} to {high}"


def _verdict(a: Side, b: Side, t: McNemar) -> str:
    return (f"{a} beats {b}" if t.a_only > t.b_only else f"{b} beats {a}") if t.p_value < LEVEL else "ties"


def compare(report: dict, a: Side, b: Side) -> list[str]:
    """The test per protocol column: the discordant chats each way, p, and the verdict; against a
    point averaged over seeds, once per draw (each draw's range and how many draws gave each verdict)."""
    for side in (a, b):  # both name a point of the run before any verdict is read
        _points(report, side)
    lines = []
    for protocol in PROTOCOLS:
        da, db = _draws(report, a, protocol), _draws(report, b, protocol)
        if len(da) > 1 and len(db) > 1 and len(da) != len(db):
            raise UserError(f"paired test unavailable: {a} and {b} were drawn {len(da)} and {len(db)} times")
        draws = max(len(da), len(db))  # a point without seeds meets each draw of the other
        tests = []
        for va, vb in ((da[k % len(da)], db[k % len(db)]) for k in range(draws)):
            if va.keys() != vb.keys():
                raise UserError(f"paired test unavailable: {a} and {b} did not answer the same chats")
            chats = sorted(va)
            tests.append(mcnemar([va[c] for c in chats], [vb[c] for c in chats]))
        head = f"{a} vs {b}, {COLUMNS[protocol]}: "
        over = f"({TEST} over the same {len(chats)} chats"
        if len(tests) == 1:
            t = tests[0]
            lines.append(f"{head}right only under {a} {t.a_only}, only under {b} {t.b_only}, p = {t.p_value:.3g} "
                         f"{over}): {_verdict(a, b, t)}")
            continue
        said = Counter(_verdict(a, b, t) for t in tests)
        verdict = ", ".join(f"{v} in {n} of {draws} draws" for v, n in said.most_common())
        lines.append(f"{head}right only under {a} {_span([t.a_only for t in tests])}, only under {b} "
                     f"{_span([t.b_only for t in tests])}, p = {_span([t.p_value for t in tests], '{:.3g}')} "
                     f"{over}, once per draw): {verdict}")
    return lines
