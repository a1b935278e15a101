"""The Compare tab: a short conversation (a question with media, then an optional follow-up), the
full cache and 1 to 4 methods run one after another through it (never interleaved, so each timing
is its own), each on its own compressed cache; answers per turn in columns, marked right or wrong
where the scene is known, a table per turn and the same panels.

:func:`respond` holds the logic with plain arguments, yielding :class:`CompareOutputs`;
:func:`run` is the event, wired to Gradio by component (:func:`components.outputs.by_component`).
The table, its marks and the notes under it: :mod:`components.compare_table`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import gradio as gr

from kv_arena import service
from kv_arena.errors import UserError

from . import api_docs, at_scale, checked_controls, clients, example_posters, mcp_calls, overlay, plots
from .compare_table import COLUMNS, WIDTHS, loyalty, table
from .compare_table import notes as table_notes
from .outputs import KEEP, Outputs, by_component, components_of
from .chat import ASSETS, TEXT_EVERY_S, box_as_sent, parse_message, progress_reporter, refusal, show_examples
from .chat import examples as chat_examples
from .chat_status import hint_line
from .settings import RANGES, SettingsPanel, control, offered, own_params, quoted, settings_from_named

SLOTS = 1 + service.MAX_COMPARE  # the full cache and up to four methods
DEFAULT_METHODS = ["h2o", "snapkv", "attention_pack", "elastic_cache"]  # at 0.2 they differ on follow-ups
DEFAULT_BUDGET = 0.2
# media without a question: every method would answer a question nobody asked, so nothing compares
NO_QUESTION = ("The first question is empty: type what to ask about the pictures or the video (the follow-up "
               "is asked after it, on the same cache).")


def last_turn(run: service.CompareRun) -> plots.Drawn | None:
    """A run as the memory, speed and layer panels draw it: its last answered turn (None: none)."""
    answered = [t for t in run.turns if t.metrics is not None]
    return plots.Drawn(run.method, answered[-1].metrics, answered[-1].layers, answered[-1].cached) if answered else None


# why random eviction can answer as the full cache (docs/benchmarks.md): said where it does. One chat
# decides no "beats" or "ties": the docs' accuracy table does, over the same chats (exact McNemar)
RANDOM_SAME = ("Why random answers as the full cache did: the first word is chosen before anything is evicted, and "
               "a uniform draw keeps a few tokens of every object for a follow-up.")


def held_line(run: service.CompareRun, full: service.CompareRun) -> str:
    """The fraction of the full cache's KV the method really holds after the first prompt, and what
    the method says of the prompt (EVS or InfiniPot-V on pictures: it held the whole cache, so its
    1.00x is no result); a method that held the whole cache without a word says so here."""
    if run is full or not run.turns or run.turns[0].metrics is None:
        return ""
    held = plots.kept_fraction(run.turns[0], full.turns[0])
    if held is None:  # the full cache held nothing to compare with
        return ""
    line = f"holds {held:.2f}x the full KV"
    notes = list(dict.fromkeys(t.note for t in run.turns if t.note))
    if not notes and held >= service.HOLDS_ALL:
        notes = ["It compressed nothing on this input: its answers are the full cache's, not a result."]
    return line + "".join(f"\n{note}" for note in notes) + "\n\n"


def loyalty_line(run: service.CompareRun, full: service.CompareRun) -> str:
    """The method's loyalty once it answered: how many of its answers are the full cache's, whole;
    where random eviction that compressed answered as the full cache, why."""
    same, answered = loyalty(run)
    if run is full or not answered:
        return ""
    line = f"\n\nloyalty {same}/{answered}: answers that are the full cache's, whole"
    held = plots.kept_fraction(run.turns[0], full.turns[0]) if run.turns[0].metrics is not None else None
    if run.name == "random" and same == answered and held is not None and held < service.HOLDS_ALL:
        line += f"\n{RANDOM_SAME}"
    return line


def answer_text(run: service.CompareRun, full: service.CompareRun) -> str:
    """What the method holds, then each turn's question and answer, marked right or wrong where the
    scene is known, then its loyalty."""
    lines = []
    for n, turn in enumerate(run.turns, start=1):
        verdict = {True: "  ✓ right", False: f"  ✗ wrong (true: {turn.truth})"}.get(
            turn.right, f"  (not marked: {turn.unmarked})" if turn.unmarked else "")
        lines.append(f"{n}. {turn.question}\n→ {turn.text}{verdict if turn.done else ''}")
    cached = "the full cache's answers are from an earlier run on this input (cached)\n\n" \
        if run is full and any(t.cached for t in run.turns) else ""
    return cached + held_line(run, full) + "\n\n".join(lines) + loyalty_line(run, full)


def column_titles(methods: list[str]) -> list[str]:
    """The answer columns' titles, known before anything runs: the full cache, then each method."""
    chosen = [m for m in dict.fromkeys(methods or []) if not service.is_reference(m)]
    return ([service.reference_spec()["title"]] + [service.title_of(m) for m in chosen] + [""] * SLOTS)[:SLOTS]


def answer_boxes(runs: tuple[service.CompareRun, ...], titles: list[str], first: bool) -> list:
    """The answer columns: on the ``first`` yield an update with each column's title and
    visibility, after that plain values (an update rebuilds the component in Gradio, ~10 ms each)."""
    texts = [answer_text(run, runs[0]) for run in runs]
    texts += ["waiting…" if title else "" for title in titles[len(runs):]]
    if not first:
        return texts
    return [gr.Textbox(label=title or None, value=text, visible=bool(title)) for title, text in zip(titles, texts)]


def scale_line(runs: tuple[service.CompareRun, ...]) -> str:
    """The computed speed at real scale of each method, at the fraction it held after the first prompt."""
    full = runs[0].turns[0] if runs[0].turns else None
    if not full or full.metrics is None:
        return ""
    fractions = {run.method: plots.kept_fraction(run.turns[0], full) for run in runs[1:]
                 if run.turns and run.turns[0].metrics is not None}
    media = next((run.visuals for run in runs if run.visuals), None)  # the same media in every method's run
    return at_scale.compare_speed_line(fractions, full.metrics.prompt_tokens, visuals=media)


def conversation(message, follow_up, num_frames: int, progress) -> list:
    """The first message (question and media) and the optional follow-up (text only), prepared."""
    text, files = parse_message(message)
    if follow_up is not None and not isinstance(follow_up, str):
        raise UserError(f"The follow-up must be text; got {type(follow_up).__name__}.")
    turns = [service.prepare(text, files, num_frames, progress_reporter(progress))]
    if (follow_up or "").strip():
        turns.append(service.prepare(follow_up, [], num_frames))
    return turns


@dataclass(frozen=True)
class CompareOutputs(Outputs):
    """What one yield of the Compare event sets, by :class:`CompareTab`'s names (KEEP: left as it is);
    ``answers``: one value per answer column."""

    answers: Any = KEEP
    table: Any = KEEP
    status: Any = KEEP
    memory: Any = KEEP
    speed: Any = KEEP
    layers: Any = KEEP
    quality: Any = KEEP
    gallery: Any = KEEP
    at_scale: Any = KEEP
    textbox: Any = KEEP
    notes: Any = KEEP  # under the table: why a turn is not marked


# what /compare returns, in order
COMPARE_RETURNS = ("one answer column per method (the full cache first; each says the fraction of the full KV it "
                   "held and its loyalty, the answers that are the full cache's), the table (KV, time to first token, "
                   "decode speed, tokens equal to the full cache's and whether the answer is the full cache's, per "
                   "turn), the status line, then the panels' figures; last, the notes under the table (why a "
                   "turn's answers are not marked).")


def respond(message, methods: list[str], session: service.Session, settings: service.Settings,
            progress=None, follow_up: str | None = "") -> Iterator[CompareOutputs]:
    """The answer columns, the table, the status and, once every method has run, the panels.
    Bad input is said once, in the status line: the rest keeps what it showed, rejected files
    leave the input box."""
    try:
        text, files = parse_message(message)
    except UserError as exc:
        yield refused(exc, {"text": "", "files": []})
        return
    files_kept = False  # a refusal about the files empties them from the box; any other keeps every input
    try:
        service.check_uploads(session, files)
        if files and not text.strip():  # the files are the session's: they stay in the box, for the question
            files_kept = True
            raise UserError(NO_QUESTION)
        if settings.num_frames > service.MAX_FRAMES:  # the frames a memory cap allows are Chat's (streamed)
            raise UserError(f"Compare prefills a video in one prompt: at most {service.MAX_FRAMES} frames (Chat "
                            "streams a longer one under a memory cap).")
        turns = conversation(message, follow_up, settings.num_frames, progress)
        files_kept = True
        views = service.compare(session, settings, methods, turns, progress_reporter(progress))
        sent = time.monotonic()
        titles, finished = column_titles(methods), -1
        for view in views:
            runs = view.runs
            done_runs = sum(run.done for run in runs)
            if not view.done and done_runs == finished and time.monotonic() - sent < TEXT_EVERY_S:
                continue  # a token of a running answer: sent at most every TEXT_EVERY_S
            first = finished == -1
            sent, finished = time.monotonic(), done_runs
            status = "Done." if view.done else f"Running {runs[-1].method}…"
            when = "before the question (the media first)" if settings.question_after else "with the question"
            status += f" Each method compressed its cache {when}."
            if view.done and len(turns) > 1:
                status += " The panels show the last turn; the table every turn."
            if service.has_random_weights(settings.model):
                status += " Random weights: the answers are nonsense, the figures are real."
            hint = service.media_hint(settings.model, turns[:1])
            status += f" {hint_line(hint)}" if hint else ""
            # the panels are drawn once, when every method has run (empty until then: plain None
            # costs Gradio less than leaving them as they are, and the table shows the progress)
            outputs = CompareOutputs(answer_boxes(runs, titles, first=first), table(runs), status, memory=None,
                                     speed=None, layers=None, quality=None, gallery=None, at_scale="",
                                     notes=table_notes(runs))
            if view.done:
                reference, others = last_turn(runs[0]), [d for d in map(last_turn, runs[1:]) if d]
                outputs = replace(outputs, memory=plots.memory_figure(others, reference),
                                  speed=plots.speed_figure(others, reference),
                                  layers=plots.layer_figure(others, reference), quality=plots.quality_figure(runs),
                                  gallery=overlay.private(session, [item for run in runs[1:] for item in
                                                                    overlay.gallery(run.visuals, prefix=run.method + ", ")]),
                                  at_scale=scale_line(runs))
            yield outputs
    except UserError as exc:  # a method refused (VisionZip on a tower without CLS, say): the pictures stay
        yield refused(exc, box_as_sent(message) if files_kept else {"text": text, "files": []})


def checked_methods(methods) -> list[str]:
    """The methods to compare as sent: a list of names (a name alone, or a nested list, is refused)."""
    if not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
        raise UserError(f"The methods to compare must be a list of method names; got {quoted(methods)}.")
    return methods


def refused(exc: UserError, box=KEEP) -> CompareOutputs:
    """Every output kept as it was but the status (the message) and the input box."""
    return CompareOutputs(status=refusal(exc), textbox=box)


def run(message, methods, follow_up: str | None = None, session=None, request: gr.Request = None, progress=gr.Progress(),
        **controls) -> Iterator[CompareOutputs]:
    """Run the full cache and 1 to 4 KV-cache methods, one after another, on the same question and optional follow-up; each method answers on its own compressed cache, and a table sets its KV bytes, speed, token agreement and loyalty (whole answer equal) against the full cache's.

    Args:
        message: the first question, {"text": the question, "files": images or one video this client uploaded (gradio_client's handle_file)}; through MCP, text only ("files": []).
        methods: the methods to compare with the full cache, 1 to 4 registry names (`python -m kv_arena.bench --list`).
        follow_up: an optional second question, answered by each method on the cache it kept for the first ("" for none).
    """
    # The Compare event (the API's /compare, documented by api_docs.documented): settings by name
    # (the budget and the methods' knobs from the Compare tab's own controls), then respond().
    session_hash = getattr(request, "session_hash", None)
    clients.track(session, request)
    with service.active(session_hash):  # a session comparing is not idle, however long it takes
        try:
            if request is not None:  # from a client (a direct call, as the tests make, may name any file)
                service.check_sent_files(parse_message(message)[1])
            checked_methods(methods)
            settings = settings_from_named(controls)
        except UserError as exc:
            yield refused(exc, box_as_sent(message))
            return
        yield from respond(message, methods, session, settings, progress, follow_up)


def limit_methods(chosen: list[str]) -> tuple[list[str], str]:
    """At most MAX_COMPARE ticked: the later ticks are undone, and the note under the boxes says which
    (cleared by the next tick within the limit)."""
    if len(chosen or []) <= service.MAX_COMPARE:  # left as ticked: sending it back raced the next tick
        return gr.skip(), ""
    dropped = ", ".join(service.title_of(n) for n in chosen[service.MAX_COMPARE:])
    return chosen[:service.MAX_COMPARE], (f"Compare runs at most {service.MAX_COMPARE} methods besides the full "
                                          f"cache: {dropped} not added. Untick one first.")


def choices(model: str | None = None) -> list[tuple[str, str]]:
    """(title, name) of the methods Compare offers for ``model`` (default: the one picked at start):
    each that runs on it, the full cache aside (it always runs first)."""
    return offered(service.default_model() if model is None else model, reference=False)  # stacks too


def methods_for_model(model: str, ticked: list[str] | None) -> gr.CheckboxGroup:
    """Model changed: the boxes offer what runs on it; a ticked method it cannot run is unticked
    (the model card says why)."""
    options = choices(model)
    names = [n for _, n in options]
    return gr.CheckboxGroup(choices=options, value=[m for m in ticked or [] if m in names])


def knob_specs() -> list[tuple[str, dict]]:
    """(method, parameter) of each method that takes no budget: the one knob that sets what it holds
    (ZipVL's tau, MPIC's mode), shown on the tab when the method is ticked."""
    return [(spec["name"], own_params(spec)[0]) for spec in service.method_specs()
            if not spec["uses_budget"] and not spec["is_reference"] and own_params(spec)]


def show_knobs(chosen: list[str]) -> list:
    return [gr.update(visible=method in (chosen or [])) for method, _ in knob_specs()]


@dataclass(frozen=True)
class SceneOutputs(Outputs):
    """What "New scene" sets: both questions and the status (KEEP: left as it is)."""

    textbox: Any = KEEP
    follow_up: Any = KEEP
    status: Any = KEEP


def new_scene(kind: str, session: service.Session | None = None, request: gr.Request = None) -> SceneOutputs:
    """A fresh scene of ``kind`` from the model's scene generator, with its true answers: it fills
    the first question (with its media) and the follow-up. Its files are the session's (they go
    with it and are served to its client only; :func:`kv_arena.service.draw_scene` caps them)."""
    try:
        if session is not None:
            clients.track(session, request)
        scene = (service.draw_scene(kind, owner=session.id, client=session.client) if session is not None
                 else service.draw_scene(kind))
    except UserError as exc:
        return SceneOutputs(status=refusal(exc))
    return SceneOutputs({"text": scene.questions[0], "files": list(scene.files)},
                        scene.questions[1] if len(scene.questions) > 1 else "",
                        f"A new {kind} scene: its answers are marked right or wrong.")


GENERAL_EXAMPLES = [("What shapes do you see?", "What colour is the triangle?", ["shapes.png"]),
                    ("Which bar is the tallest?", "Which bar is the shortest?", ["chart.png"]),
                    ("Where does the ball go?", "What colour is the ball?", ["bouncing_ball.mp4"])]


def example_rows(trained: bool) -> list[list]:
    """Clickable examples filling both questions: the offline model's scenes (answers known), or
    general ones for hub models."""
    if trained:
        return [[{"text": s.questions[0], "files": list(s.files)}, s.questions[1] if len(s.questions) > 1 else ""]
                for s in service.scene_examples()]
    return [[{"text": first, "files": [str(ASSETS / f) for f in files]}, then] for first, then, files in GENERAL_EXAMPLES
            if all((ASSETS / f).is_file() for f in files)]


def example_css() -> str:
    """Every example video's still preview (both sets; "Can you tell?"'s show the same files, Chat's
    these and its long video)."""
    rows = example_rows(True) + example_rows(False) + chat_examples(service.ARENA)
    return example_posters.css(example_posters.videos_of(rows))


@dataclass
class CompareTab:
    """The Compare tab's controls and outputs (named as :class:`CompareOutputs`' fields)."""

    methods: gr.CheckboxGroup
    textbox: gr.MultimodalTextbox
    follow_up: gr.Textbox
    button: gr.Button
    answers: list
    table: gr.Dataframe
    status: gr.Markdown
    memory: gr.Plot
    speed: gr.Plot
    layers: gr.Plot
    quality: gr.Plot
    gallery: gr.Gallery
    at_scale: gr.Markdown
    notes: gr.Markdown

    @property
    def outputs(self) -> list:
        return components_of(self, CompareOutputs)


def build_compare(settings: SettingsPanel, session: gr.State) -> CompareTab:
    gr.Markdown("The full cache answers first, then each method in turn, each through the whole conversation (the "
                "question, then the follow-up) on its own compressed cache. The full cache's run is reused when the "
                "input repeats. Budget and knobs below apply here; other parameters are the papers' defaults or as "
                "set under the Chat tab's Advanced.")
    options = choices()
    methods = checked_controls.CheckboxGroup(options, value=DEFAULT_METHODS, label=f"Methods (1 to {service.MAX_COMPARE})",
                                             elem_id="compare-methods")
    methods_note = gr.Markdown(elem_id="compare-methods-note")  # a refused tick, said under the boxes
    with gr.Row():
        low, high = RANGES["budget"]
        budget = checked_controls.Slider(low, high, value=DEFAULT_BUDGET, step=0.01, label="Budget of every method compared",
                           info="Fraction of the full cache's KV bytes each method may hold.", elem_id="compare-budget",
                           elem_classes=["range-said"])
        knobs = [control(p, f"{service.method_spec(m)['title']}: {p['name'].replace('_', ' ')}")
                 for m, p in knob_specs()]
        for (method, _), knob in zip(knob_specs(), knobs):
            knob.visible = method in DEFAULT_METHODS
    # the examples first, then the question, the button and the answers together: with the examples
    # between them the button sat 1,780 px under the question on a phone, and the answers under the examples
    textbox = checked_controls.MultimodalTextbox(file_types=["image", "video"], file_count="multiple",
                                                 elem_id="compare-input", show_label=False, label="Message", submit_btn=False,
                                                 placeholder="First question, with images or a video…", render=False)
    follow_up = gr.Textbox(value="", label="Then ask (optional follow-up, on the same compressed cache)", elem_id="compare-then",
                           placeholder="e.g. a question about another object", render=False)
    trained = service.is_trained_here(settings.model.value)
    example_sets = []
    for shown, kind in ((trained, True), (not trained, False)):  # one set per kind of model, one visible
        with gr.Column(visible=shown) as column:
            rows = example_rows(kind)
            if rows:
                gr.Examples(rows, inputs=[textbox, follow_up], elem_id="compare-examples" if kind else None, label="Examples (both questions; answers marked right "
                            "or wrong)" if kind else "Examples (for hub models)", api_visibility="private")
            if kind:
                with gr.Row():
                    scene_kind = checked_controls.Dropdown(  # an unknown kind: the app's one line, not Gradio's
                        list(service.scene_types()), value=service.scene_types()[0], label="Scene type", scale=1,
                        elem_id="scene-kind")
                    scene_button = gr.Button("New scene", scale=1, elem_id="new-scene")
        example_sets.append(column)
    textbox.render()
    follow_up.render()
    button = gr.Button("Compare", variant="primary", elem_id="compare-run")
    status = gr.Markdown(elem_id="compare-status", label="Status")
    with gr.Row(equal_height=True):
        answers = [gr.Textbox(visible=False, lines=6, max_lines=40, elem_classes=["answer"], label=f"Answers {i + 1}")
                   for i in range(SLOTS)]
    grid = gr.Dataframe(headers=COLUMNS, interactive=False, elem_id="compare-table", wrap=True, column_widths=WIDTHS,
                        label="Table", show_label=False, max_height=4000)  # every row in view, no inner scrolling
    grid_notes = gr.Markdown(elem_id="compare-notes")  # why a turn is "not marked", once
    gr.Markdown("Every *vs full* column is a ratio to the full cache's same turn (0.50x = half); the KV one is exact, "
                f"the speed ones are measured. {plots.NOT_TOLD_NOTE}. *Answer (s)*: the model's own time for "
                "the answer (first token and decode). *Right?*: against the scene's true answer (the offline "
                "model's scenes only). *Same tokens as full*: answer tokens equal to the full cache's, position by "
                "position. *Loyal to full*: ✓ where the whole answer is the full cache's (normalised), right or wrong; "
                "each answer column gives the method's **loyalty**, the share of its answers that are.")
    with gr.Row():
        memory = gr.Plot(label="KV memory")
        speed = gr.Plot(label="Speed")
    with gr.Row():
        layers = gr.Plot(label="Per-layer budget")
        quality = gr.Plot(label="Quality vs memory", elem_id="compare-quality")
    speed_scale = gr.Markdown(elem_id="compare-scale", label="Computed speed at real scale")
    gallery = gr.Gallery(label="Which visual tokens each method kept (averaged over layers; AttentionPack: which "
                         "it holds at full rank, ZipVL: at high precision)", columns=2, height="auto",
                         object_fit="contain", preview=False, fit_columns=False, elem_id="compare-overlay")
    tab = CompareTab(methods, textbox, follow_up, button, answers, grid, status, memory, speed, layers, quality, gallery,
                     speed_scale, grid_notes)
    methods.input(limit_methods, methods, [methods, methods_note], api_visibility="private")
    methods.change(show_knobs, methods, knobs, api_visibility="private")
    settings.model.change(show_examples, settings.model, example_sets, api_visibility="private")
    settings.model.change(methods_for_model, [settings.model, methods], methods, api_visibility="private")
    # queued, one at a time: each call draws and writes a scene (capped per session and in all)
    scene_button.click(by_component(tab, new_scene), [scene_kind, session], components_of(tab, SceneOutputs),
                       concurrency_id="scenes", concurrency_limit=1, api_visibility="private")
    own = {"budget": budget} | {f"{m}_{p['name']}": knob for (m, p), knob in zip(knob_specs(), knobs)}
    lines = api_docs.control_lines() | {"budget": "the budget of every method compared: " + api_docs.BASE["budget"]}
    event = api_docs.documented(by_component(tab, mcp_calls.own_session(run)), "compare", COMPARE_RETURNS, lines)
    button.click(event, [textbox, methods, follow_up, session], tab.outputs,
                 inputs_kwargs=settings.named | own,
                 api_name="compare", concurrency_id="gpu", concurrency_limit=1)
    return tab
