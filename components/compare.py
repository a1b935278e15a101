"""The Compare tab: one prompt and media, the full cache and 1 to 4 methods run one after another
(never interleaved, so each timing is its own), answers in columns, a table and the same panels.

:func:`respond` holds the logic with plain arguments; :func:`run` is the wired event.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import gradio as gr

from engine import service
from engine.errors import UserError

from . import checked_controls, clients, overlay, plots
from .chat import PLOT_EVERY_S, fmt_bytes, parse_message, progress_reporter, refusal
from .settings import SettingsPanel, settings_from_named

COLUMNS = ["Method", "KV after prompt", "KV vs full", "TTFT (s)", "TTFT vs full", "Decode tok/s", "Decode vs full",
           "Same tokens as full", "Note"]
WIDTHS = ["15%", "10%", "8%", "8%", "10%", "9%", "10%", "9%", "21%"]  # the Note column gets room for its words
SLOTS = 1 + service.MAX_COMPARE  # the full cache and up to four methods


def table(runs: list[dict]) -> list[list]:
    """One row per run; every "vs full" column a ratio to the full cache (the first run), the
    KV one measured after the prompt (the fraction of the full cache's bytes the method holds)."""
    full = runs[0]
    rows = []
    for run in runs:
        m, fm = run["metrics"], full["metrics"]
        is_full = run is full
        note = "cached: from an earlier run on this input" if run.get("cached") else ("" if run.get("done") else "running…")
        spread = plots.step_spread(run, full)
        rows.append([run["method"], fmt_bytes(m["kv_bytes_prefill"]),
                     "" if is_full else plots.vs_full(m["kv_bytes_prefill"], fm["kv_bytes_prefill"]),
                     round(m["ttft_s"], 3), "" if is_full else plots.vs_full(m["ttft_s"], fm["ttft_s"], spread),
                     round(m["decode_tok_s"], 1),
                     "" if is_full else plots.vs_full(m["decode_tok_s"], fm["decode_tok_s"], spread),
                     "" if run.get("agreement") is None else f"{run['agreement']:.0%}", note])
    return rows


def answer_label(run: dict, full: dict) -> str:
    """An answer column's title: the method and the fraction of the full cache's KV it really holds."""
    fraction = plots.kept_fraction(run, full) if run is not full and run.get("metrics") else None
    return plots.series_name(run) + ("" if fraction is None else f" · holds {fraction:.2f}x the full KV")


def answer_boxes(runs: list[dict]) -> list:
    boxes = [gr.Textbox(label=answer_label(run, runs[0]), value=run.get("text", ""), visible=True) for run in runs]
    return boxes + [gr.Textbox(visible=False, value="")] * (SLOTS - len(boxes))


def respond(message, methods: list[str], session: service.Session, settings: service.Settings,
            progress=None) -> Iterator[tuple]:
    """Yields (5 answer boxes, table, status, memory, speed, layers, quality, overlay gallery, input box).
    Bad input is said once, in the status line: the rest keeps what it showed, rejected files
    leave the input box."""
    text, files = parse_message(message)
    try:
        service.check_uploads(session, files)
        prepared = service.prepare(text, files, settings.num_frames, progress_reporter(progress))
        views = service.compare(session, settings, methods, prepared, progress_reporter(progress))
        drawn = 0.0
        for view in views:
            runs = view["runs"]
            reference, others = runs[0], runs[1:]
            redraw = view["done"] or time.monotonic() - drawn > PLOT_EVERY_S
            figures = (plots.memory_figure(others, reference), plots.speed_figure(others, reference),
                       plots.layer_figure(others, reference), plots.quality_figure(others, reference)) \
                if redraw else (gr.skip(),) * 4
            drawn = time.monotonic() if redraw else drawn
            items = [item for run in others for item in overlay.gallery(run["visuals"], prefix=run["method"] + ", ")]
            status = "Done." if view["done"] else f"Running {runs[-1]['method']}…"
            if service.has_random_weights(settings.model):
                status += " Random weights: the answers are nonsense, the figures are real."
            hint = service.media_hint(settings.model, [prepared])
            status += f" {hint}" if hint else ""
            yield (*answer_boxes(runs), table(runs), status, *figures, items if view["done"] else gr.skip(), gr.skip())
    except UserError as exc:
        yield refused(exc, {"text": text, "files": []})


def refused(exc: UserError, box) -> tuple:
    """Every output kept as it was but the status (the message) and the input box."""
    return (*(gr.skip(),) * (SLOTS + 1), refusal(exc), *(gr.skip(),) * 5, box)


def run(message, methods, session, request: gr.Request, progress=gr.Progress(), **controls):
    """The Compare event (the API's ``/compare``): settings by name, then :func:`respond`."""
    service.track(session, getattr(request, "session_hash", None), clients.client_of(request))
    try:
        settings = settings_from_named(controls)
    except UserError as exc:
        yield refused(exc, gr.skip())
        return
    yield from respond(message, methods, session, settings, progress)


def limit_methods(chosen: list[str]) -> tuple[list[str], str]:
    """At most MAX_COMPARE ticked: the later ticks are undone, and the status says which."""
    if len(chosen or []) <= service.MAX_COMPARE:
        return chosen, ""
    dropped = ", ".join(service.method_spec(n)["title"] for n in chosen[service.MAX_COMPARE:])
    return chosen[:service.MAX_COMPARE], (f"Compare runs at most {service.MAX_COMPARE} methods besides the full "
                                          f"cache: {dropped} not added. Untick one first.")


def choices() -> list[tuple[str, str]]:
    return [(spec["title"], spec["name"]) for spec in service.method_specs() if spec["name"] != "full"]


@dataclass
class CompareTab:
    methods: gr.CheckboxGroup
    textbox: gr.MultimodalTextbox
    button: gr.Button
    answers: list
    table: gr.Dataframe
    status: gr.Markdown
    memory: gr.Plot
    speed: gr.Plot
    layers: gr.Plot
    quality: gr.Plot
    gallery: gr.Gallery

    @property
    def outputs(self) -> list:
        return [*self.answers, self.table, self.status, self.memory, self.speed, self.layers, self.quality,
                self.gallery, self.textbox]


def build_compare(settings: SettingsPanel, session: gr.State) -> CompareTab:
    gr.Markdown("The full cache runs first, then each method in turn on the same input, with the budget and "
                "parameters set on the left. The full cache's run is reused when the input repeats.")
    options = choices()
    methods = checked_controls.CheckboxGroup(options, value=[n for _, n in options[:2]],
                                             label=f"Methods (1 to {service.MAX_COMPARE})", elem_id="compare-methods")
    textbox = checked_controls.MultimodalTextbox(file_types=["image", "video"], file_count="multiple",
                                                 elem_id="compare-input", show_label=False, submit_btn=False,
                                                 placeholder="One prompt with images or a video for every method…")
    button = gr.Button("Compare", variant="primary", elem_id="compare-run")
    status = gr.Markdown(elem_id="compare-status")
    with gr.Row(equal_height=True):
        answers = [gr.Textbox(visible=False, lines=6, max_lines=12, elem_classes=["answer"]) for _ in range(SLOTS)]
    grid = gr.Dataframe(headers=COLUMNS, interactive=False, elem_id="compare-table", wrap=True, column_widths=WIDTHS)
    gr.Markdown("Every *vs full* column is a ratio to the full cache (0.50x = half). *~ same*: the difference is "
                "smaller than the spread of the decode steps' times on this machine, i.e. noise; *(noise ?)*: too few "
                "decode steps to measure that spread.")
    with gr.Row():
        memory = gr.Plot(label="KV memory")
        speed = gr.Plot(label="Speed")
    with gr.Row():
        layers = gr.Plot(label="Per-layer budget")
        quality = gr.Plot(label="Quality vs memory", elem_id="compare-quality")
    gallery = gr.Gallery(label="Which visual tokens each method kept (averaged over layers)", columns=2, height="auto",
                         object_fit="contain", preview=False, fit_columns=False)  # 2 columns: captions fit
    tab = CompareTab(methods, textbox, button, answers, grid, status, memory, speed, layers, quality, gallery)
    methods.input(limit_methods, methods, [methods, status], queue=False, api_visibility="private")
    button.click(run, [textbox, methods, session], tab.outputs, inputs_kwargs=settings.named, api_name="compare",
                 concurrency_id="gpu", concurrency_limit=1)
    return tab
