"""What every benchmark's command line shares: its ``main`` (parse, run, print a table or JSON,
exit code 2 on bad input) and the right-aligned table it prints."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from ..errors import UserError


def add_run_args(parser) -> None:
    """The flags every benchmark on a loaded model takes: where it runs, its seed, JSON output."""
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def visual_sizes(text: str) -> list[int]:
    """``--visual-tokens``: comma-separated positive integers."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--visual-tokens expects comma-separated integers, got '{text}'") from None
    if not sizes or min(sizes) < 1:
        raise UserError("--visual-tokens needs positive sizes")
    return sizes


def aligned(cells: list[list[str]]) -> list[str]:
    """Rows of cells right-aligned in columns (the first row is the header)."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]


def run_main(parse_args: Callable, run: Callable, table: Callable[[list[dict]], str], argv=None,
             before: Callable | None = None) -> int:
    """Parse ``argv``, run, print ``table(rows)`` (the rows as JSON with ``--json``); a bad input is
    one line on stderr and exit code 2. ``before(args)`` may answer instead (returns an exit code or None)."""
    args = parse_args(argv)
    try:
        code = before(args) if before else None
        if code is not None:
            return code
        rows = run(args)
    except (UserError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2, default=str) if getattr(args, "json", False) else table(rows))
    return 0
