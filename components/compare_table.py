"""Compare's table: one row per method and turn, its marks, the notes under it (why a turn is not
marked, said once for every row) and the CSS that keeps it readable on a phone and a laptop."""

from __future__ import annotations

from kv_arena import service

from . import plots

COLUMNS = ["Method", "Turn", "KV vs full", "TTFT (s)", "TTFT vs full", "Decode tok/s", "Decode vs full",
           "Answer (s)", "Same tokens as full", "Right?", "Loyal to full"]
# "Turn" at 7%: 5% of a laptop's 900 px table left it no room beside the header's menu button ("Tur|n")
WIDTHS = ["14%", "7%", "8%", "8%", "10%", "8%", "10%", "8%", "9%", "10%", "8%"]
WORDS = ("Method", "Right?")  # the columns of words, which may wrap between them; every other holds a number or a mark
NOT_MARKED = "not marked"
MIN_WIDTH_PX = 900  # a laptop's table: narrower, it scrolls sideways rather than stand a number a digit a line

# A number never breaks inside (390 px wide, "0.775" stood one character a line) and a header only
# between words; on a narrow screen the table keeps MIN_WIDTH_PX and scrolls sideways in its box (the
# viewport's parent): Gradio sets each column's width from its share of the viewport's, so a wider
# viewport widens them.
TABLE_CSS = """
#compare-table th span.header { overflow-wrap: normal; word-break: keep-all; }
#compare-table [role=gridcell]:not(NUMBERLESS) span.text { white-space: nowrap; }
@media (max-width: 768px) {
  #compare-table .upload-container { overflow-x: auto; }
  #compare-table .virtual-table-viewport { min-width: MINpx; }
}
""".replace("NUMBERLESS", ", ".join(f'[data-col="{COLUMNS.index(c)}"]' for c in WORDS)).replace("MIN", str(MIN_WIDTH_PX))


def answer_seconds(metrics: service.Meters) -> float:
    """The model's own time for one answer: to the first token, then every decode step."""
    return metrics.ttft_s + metrics.decode_s


def mark(turn: service.CompareTurn) -> str:
    """Right or wrong against the scene's true answer; "" when there is none (uploads, hub models).
    A question the scene cannot answer is "not marked": why is said once, under the table
    (:func:`notes`; in the cell it made each row about 400 px tall)."""
    if turn.right is None:
        return NOT_MARKED if turn.unmarked and turn.done else ""
    return "✓" if turn.right else f"✗ (true: {turn.truth})"


def loyal_mark(turn: service.CompareTurn) -> str:
    """Whether the answer is the full cache's answer, whole (normalised), right or wrong: ✓ or ✗ ("" until done)."""
    return "" if turn.loyal is None else "✓" if turn.loyal else "✗"


def loyalty(run: service.CompareRun) -> tuple[int, int]:
    """(answers that are the full cache's, answers given): the method's loyalty over the turns so far."""
    done = [t for t in run.turns if t.loyal is not None]
    return sum(t.loyal for t in done), len(done)


def table(runs: tuple[service.CompareRun, ...]) -> list[list]:
    """One row per run and turn; every "vs full" column a ratio to the full cache's same turn, the
    KV one measured after that turn's prompt (the fraction of the full cache's bytes it holds); a
    full cache's row from an earlier run on the same input says "(cached)". *Same tokens as full* is
    the share of answer tokens equal to the full cache's, position by position; *Loyal to full* whether
    the whole answer is the full cache's (what loyalty counts)."""
    full = runs[0].turns
    rows = []
    for run in runs:
        is_full = run is runs[0]
        for n, (turn, ref) in enumerate(zip(run.turns, full), start=1):
            if turn.metrics is None:
                continue
            m, fm = turn.metrics, ref.metrics
            name = run.method + (" (cached)" if turn.cached else "" if turn.done else " (running…)")
            rows.append([name, n, "" if is_full else plots.vs_full(m.kv_bytes_prefill, fm.kv_bytes_prefill),
                         round(m.ttft_s, 3), "" if is_full else plots.shown_ratio(plots.speed_ratio(turn, ref, "ttft_s")),
                         round(m.decode_tok_s, 1),
                         "" if is_full else plots.shown_ratio(plots.speed_ratio(turn, ref, "decode_tok_s")),
                         round(answer_seconds(m), 3),
                         "" if turn.agreement is None else f"{turn.agreement:.0%}", mark(turn),
                         "" if is_full else loyal_mark(turn)])
    return rows


def notes(runs: tuple[service.CompareRun, ...]) -> str:
    """Under the table, once per turn: why its rows say "not marked" (the scene cannot answer the
    question; the same for every method, so not repeated in each row); "" when every turn is marked."""
    said = {}
    for run in runs:
        for n, turn in enumerate(run.turns, start=1):
            if mark(turn) == NOT_MARKED:
                said.setdefault(n, turn.unmarked)
    return "\n\n".join(f"*{NOT_MARKED.capitalize()}*, turn {n}: {why.rstrip('.')}." for n, why in sorted(said.items()))
