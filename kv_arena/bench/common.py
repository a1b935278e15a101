"""What every benchmark's command line shares: its ``main`` (parse, run, print a table or JSON,
exit code 2 on bad input), the right-aligned table it prints, and how a timed ratio is reported:
repeats interleaved, each repeat's ratio taken against the reference's run of the same repeat, the
median printed with the min-max of the repeats, and a mark where that range crosses 1."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kv_arena import backends

from ..errors import UserError


def add_run_args(parser) -> None:
    """The flags every benchmark on a loaded model takes: where it runs, its seed, JSON output."""
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_repeats_arg(parser, default: int = 3) -> None:
    """``--repeats``: a ratio from one run on a shared machine says nothing, hence at least 3."""
    parser.add_argument("--repeats", type=int, default=default,
                        help=f"interleaved runs per point; the median is printed with the min-max (default {default})")


def visual_sizes(text: str) -> list[int]:
    """``--visual-tokens``: comma-separated positive integers."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--visual-tokens expects comma-separated integers, got '{text}'") from None
    if not sizes or min(sizes) < 1:
        raise UserError("--visual-tokens needs positive sizes")
    return sizes


REFERENCE = backends.reference_name()  # the method every ratio is measured against (the full cache)
UNSURE = "~"  # marks a ratio whose repeats do not tell it from 1
SPREAD_NOTE = (f"ratios: median (min-max) of per-repeat ratios; {UNSURE} the range crosses 1 "
               "(or one repeat): not told apart from 1")


@dataclass(frozen=True)
class Spread:
    """A timed ratio over repeats: the median and the range of the per-repeat values."""

    median: float
    low: float
    high: float
    repeats: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Spread":
        values = list(values)
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values), len(values))

    @classmethod
    def paired(cls, measured: Sequence[float], reference: Sequence[float]) -> "Spread":
        """``measured[r] / reference[r]`` per repeat: both ran in the same repeat, so drift on a
        shared machine hits them alike and cancels in the ratio."""
        if len(measured) != len(reference):
            raise ValueError("paired ratios need one reference run per repeat")
        return cls.of(m / r for m, r in zip(measured, reference))

    @property
    def unsure(self) -> bool:
        """The repeats do not tell this ratio from 1 (or there is only one)."""
        return self.repeats < 2 or self.low <= 1.0 <= self.high

    def cell(self, digits: int = 2) -> str:
        """``0.93 (0.88-0.97)``, with the mark appended where the range crosses 1."""
        return (f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"
                + (UNSURE if self.unsure else ""))

    def fields(self, name: str) -> dict:
        """The JSON fields of ratio ``name``: its median and ``name_range`` = [min, max]."""
        return {name: self.median, f"{name}_range": [self.low, self.high]}


def rotated(names: Sequence, repeat: int) -> list:
    """The order of repeat ``repeat``: rotated by one each repeat, so no name always runs first."""
    shift = repeat % len(names)
    return list(names[shift:]) + list(names[:shift])


def check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise UserError("--repeats must be at least 1")


def aligned(cells: list[list[str]]) -> list[str]:
    """Rows of cells right-aligned in columns (the first row is the header)."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]


def run_main(parse_args: Callable, run: Callable, table: Callable[[list[dict]], str], argv=None,
             before: Callable | None = None, live: Callable[[dict, bool], str] | None = None) -> int:
    """Parse ``argv``, run, print ``table(rows)`` (the rows as JSON with ``--json``); a bad input is
    one line on stderr and exit code 2. ``before(args)`` may answer instead (returns an exit code or None).
    With ``live``, ``run`` may yield its rows one by one and each is printed as it comes,
    ``live(row, first)`` (``first``: the header goes with it), instead of the table at the end."""
    args = parse_args(argv)
    as_json = getattr(args, "json", False)
    try:
        code = before(args) if before else None
        if code is not None:
            return code
        rows = []
        for row in run(args):
            if live is not None and not as_json:
                print(live(row, not rows), flush=True)
            rows.append(row)
    except (UserError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    elif live is None:
        print(table(rows))
    return 0
