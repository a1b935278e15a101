"""The Chat tab: a multi-turn chat with images and videos, streamed token by token, with live
panels (KV memory, speed, per-layer budget) and the kept-visual-token overlay.

:func:`respond` is the event's logic with plain arguments (tests call it directly), yielding
:class:`ChatOutputs`; :func:`submit` is the event, with the settings' values, wired to
Gradio by component (:func:`components.outputs.by_component`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gradio as gr

from kv_arena import service
from kv_arena.errors import UserError

from . import api_docs, checked_controls, clients, mcp_calls, media_library, overlay
from .chat_status import hint_line, measured, panels, status_line
from .history import NEW_CONVERSATION, REREAD, SWITCHED, rereadable_turns, said, transcript, with_own_files
from .outputs import KEEP, Outputs, by_component, components_of
from .settings import SettingsPanel, render_method_controls, settings_from_named

log = logging.getLogger(__name__)
PLOT_EVERY_S = 0.4  # redraw the panels at most this often while streaming
# send the text at most this often while streaming: each message costs Gradio a rebuild of every
# output it leaves as it is (KEEP), ~10 ms each, more than a tiny model's whole decode step
TEXT_EVERY_S = 0.1
ASSETS = Path(__file__).resolve().parents[1] / "assets"
EMPTY_INPUT = {"text": "", "files": []}
NOT_ANSWERED = "**Not answered:**"


def refusal(exc: UserError) -> str:
    """A user error as the status line says it, logged as one line (never a traceback)."""
    log.info("user error: %s", exc)
    return f"{NOT_ANSWERED} {exc}"


def parse_message(message: dict | str | None, checked: bool = True) -> tuple[str, list[str]]:
    """MultimodalTextbox value -> (text, file paths); a value of another shape, or (``checked``) text
    that is not valid Unicode (a lone surrogate) or over the text limits, is a UserError."""
    if isinstance(message, str) or message is None:
        text, files = message or "", []
    elif isinstance(message, dict):
        text, sent = message.get("text") or "", message.get("files") or []
        if not isinstance(sent, list):
            raise UserError(f"The message's files must be a list; got {type(sent).__name__}.")
        files = [f.get("path") if isinstance(f, dict) else f for f in sent]
    else:
        raise UserError(f"The message must be text, or text with files; got {type(message).__name__}.")
    if not isinstance(text, str) or not all(isinstance(f, str) for f in files):
        raise UserError("The message's text and each file's path must be text.")
    return (service.checked_text(text) if checked else text), files


def shown_or(value, check, fallback):
    """``value`` where ``check`` accepts it (it can be shown back as sent), else ``fallback``."""
    try:
        check(value)
    except UserError:
        return fallback
    return value


def checked_history(history) -> list:
    """The chat history as sent: a list of messages, each a dict with a role and a content (a
    malformed one, sent through the API, is a UserError; see ``checked_controls.Chatbot``)."""
    if history is None:
        return []
    if isinstance(history, checked_controls.MalformedHistory) or not isinstance(history, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
            and isinstance(m.get("content"), (str, list, dict, type(None))) for m in history):
        raise UserError("The chat history is not a list of messages (each with a role and a content); "
                        "send the history the app returned, or an empty one.")
    for message in history:
        text, _ = said(message.get("content"))
        service.checked_text(text)
    return history


def refused_turn(exc: UserError, message, history) -> ChatOutputs:
    """A turn refused before it started: the chat and the message back as sent where they can be
    shown (a malformed one is left as it was), the reason under them."""
    return ChatOutputs(chatbot=shown_or(history, checked_history, KEEP), status=refusal(exc), textbox=box_as_sent(message))


def box_as_sent(message) -> dict:
    """The input box as a refused message left it: its text and its files where they can be shown
    (a file from outside the upload folder cannot: Gradio would not serve it), else empty."""
    try:  # a text over the limits stays in the box, to be shortened there
        text, files = parse_message(message, checked=False)
        text.encode("utf-8")  # a lone surrogate cannot be sent back
    except (UserError, UnicodeEncodeError):
        return EMPTY_INPUT
    return {"text": text, "files": shown_or(files, service.check_sent_files, [])}


WHY_NEW = {"model": "The model changed, so this is a new conversation: the messages above are not in its memory."}


def held_by(settings: service.Settings) -> str:
    """The method that holds the conversation now, with its budget where it takes one (a change of
    budget alone is a switch too)."""
    try:
        uses_budget = service.method_spec(settings.method)["uses_budget"]
    except ValueError:
        return settings.method
    return service.title_of(settings.method) + (f" at a budget of {settings.budget:.2f}" if uses_budget else "")


def switch_line(text: str, fate: str = "switches") -> dict:
    """The chat's line where another method takes a conversation over (``fate`` "switches"), or where
    a history sent is re-read ("history")."""
    return {"role": "assistant", "content": text, "metadata": {"title": REREAD if fate == "history" else SWITCHED}}


def switched(note: service.SwitchNote, fate: str = "switches", settings: service.Settings | None = None) -> str:
    """The chat's line for a conversation another method (or budget, or knob: ``settings``) took over,
    or a history sent it re-read, with what the re-read cost."""
    turns = f"{note.turns} turn{'s' if note.turns != 1 else ''}"
    cost = f"({note.tokens} tokens, {note.seconds:.2f} s)"
    holder = held_by(settings) if settings is not None else note.method
    if fate == "history":
        return (f"The history sent is not the conversation this session held (it was edited, or sent from another "
                f"client), so {holder} re-read its {turns} above, files and answers as sent {cost}.")
    return (f"Now held by {holder}: it re-read the {turns} above {cost}, "
            "so the next answers come from its cache.")


def user_messages(text: str, files: list[str]) -> list[dict]:
    content = [{"path": f} for f in files] + ([text] if text else [])
    return [{"role": "user", "content": content}]


def progress_reporter(progress):
    return (lambda fraction, text: progress(fraction, desc=text)) if progress is not None else (lambda f, t: None)


@dataclass(frozen=True)
class ChatOutputs(Outputs):
    """What one yield of the chat event sets, by :class:`ChatTab`'s names (KEEP: left as it is)."""

    chatbot: Any = KEEP
    textbox: Any = KEEP
    status: Any = KEEP
    memory: Any = KEEP
    speed: Any = KEEP
    layers: Any = KEEP
    layer_picker: Any = KEEP
    gallery: Any = KEEP
    scale_line: Any = KEEP
    realised: Any = KEEP


# what /chat returns, in order (the API's outputs are named by these components' labels)
CHAT_RETURNS = ("the conversation with the answer last (Chat), the message box (Message), the status line: the "
                "method, the fraction of the full cache's KV it held and its speed against the full cache (Status), "
                "then the panels' figures and the kept-token overlays.")


def respond(message, history: list, session: service.Session, settings: service.Settings,
            progress=None, sent_by_client: bool = False) -> Iterator[ChatOutputs]:
    """Answer one message: the chat, the panels, the kept-token overlay and the notes as it streams.
    Bad input is said once, in the status line under the input: the chat and the panels keep what
    they showed, the rejected files leave the input box (the text stays). A history that is not the
    session's conversation is re-read, its files and answers included (``sent_by_client``: sent
    through a request, so each file it names must be an upload of this client's)."""
    try:
        history = list(checked_history(history))
    except UserError as exc:
        yield refused_turn(exc, message, history)
        return
    history = with_own_files(history, session)  # the server's own copies: files this client may fetch back
    try:
        text, files = parse_message(message)
    except UserError as exc:
        yield ChatOutputs(chatbot=history, status=refusal(exc), textbox=box_as_sent(message))
        return
    try:
        service.check_uploads(session, files)
        prepared = service.prepare(text, files, settings.num_frames, progress_reporter(progress))
    except UserError as exc:
        yield ChatOutputs(chatbot=history, textbox={"text": text, "files": []}, status=refusal(exc))
        return
    shown, turns = history, transcript(history)
    fate = session.fate(settings, turns)  # the history sent is the conversation, is re-read, or a new one starts
    if fate == "history":  # not the session's conversation: it becomes it, media and answers as sent
        try:
            service.take_history(session, settings, rereadable_turns(history, sent_by_client),
                                 progress_reporter(progress))
        except UserError as exc:
            yield ChatOutputs(chatbot=history, textbox=message, status=refusal(exc))
            return
    if history and fate in WHY_NEW:
        shown = shown + [{"role": "assistant", "content": WHY_NEW[fate], "metadata": {"title": NEW_CONVERSATION}}]
    switch_at = None
    if fate in ("switches", "history"):  # said where it happens; its cost filled in once the re-read is done
        doing = "re-reads the history sent" if fate == "history" else "re-reads the conversation"
        switch_at, shown = len(shown), shown + [switch_line(f"{held_by(settings)} {doing}…", fate)]
    shown = shown + user_messages(text, files)
    answer = {"role": "assistant", "content": "…"}
    # the panels empty while it works (plain values: cheaper for Gradio than leaving them as they are)
    yield ChatOutputs(shown + [answer], EMPTY_INPUT, "Working…", memory=None, speed=None, layers=None,
                      layer_picker=overlay.MEAN, gallery=None, scale_line="")
    hint = service.media_hint(settings.model, (session.history if fate in ("continues", "switches", "history") else []) + [prepared])
    drawn = sent = time.monotonic()  # the first figures when done, or after PLOT_EVERY_S of streaming
    try:
        for view in service.chat_turn(session, settings, prepared, progress_reporter(progress), shown=turns):
            if isinstance(view, service.ProgressNote):  # between a streamed prefill's chunks
                if time.monotonic() - sent >= TEXT_EVERY_S:  # handed to Gradio: a client gone stops it here
                    sent = time.monotonic()
                    yield ChatOutputs(status=f"Working… {view.text}")
                continue
            if not view.done and time.monotonic() - sent < TEXT_EVERY_S:
                continue
            sent = time.monotonic()
            if view.switch is not None and switch_at is not None:
                shown = shown[:switch_at] + [switch_line(switched(view.switch, fate, settings), fate)] + shown[switch_at + 1:]
                switch_at = None
            status = status_line(view, settings, bool(files)) + (f"\n\n{hint_line(hint)}" if hint else "")
            outputs = ChatOutputs(shown + [{"role": "assistant", "content": view.text or "…"}], status=status)
            if view.done or time.monotonic() - drawn > PLOT_EVERY_S:
                memory, speed, layers = panels(view)
                outputs = replace(outputs, memory=memory, speed=speed, layers=layers)
                drawn = time.monotonic()
            if view.done:
                scale, realised = measured(view)
                picker = gr.Dropdown(choices=overlay.layer_choices(len(view.layers.tokens)), value=overlay.MEAN)
                gallery = overlay.private(session, overlay.gallery(view.visuals))
                outputs = replace(outputs, layer_picker=picker, gallery=gallery, scale_line=scale,
                                  realised=KEEP if realised is None else realised)
            yield outputs
    except UserError as exc:
        yield ChatOutputs(chatbot=history, textbox=message, status=refusal(exc))  # the chat as it was, the message back


def submit(message, history, session, request: gr.Request, progress=gr.Progress(), **controls) -> Iterator[ChatOutputs]:
    """Ask a vision-language model about images or a video while a KV-cache method decides what its cache keeps; the answer comes with what the method held, saved and cost against the full cache on the same input.

    Args:
        message: the user's message, {"text": the question, "files": images or one video this client uploaded (gradio_client's handle_file)}; through MCP, text only ("files": []).
        history: the conversation as the previous /chat call returned it (its first output), or [] to start a new one, which frees this session's cache.
    """
    # The Chat event (the API's /chat, documented by api_docs.documented): settings from the
    # column's controls, by name (settings.control_names()), then respond().
    session_hash = getattr(request, "session_hash", None)
    clients.track(session, request)
    with service.active(session_hash):  # a session answering is not idle, however long it takes
        try:
            checked_history(history)
            if request is not None:  # from a client (a direct call, as the tests make, may name any file)
                service.check_sent_files(parse_message(message)[1])
            settings = settings_from_named(controls)
        except UserError as exc:  # the chat and the message as they were, the reason under them
            yield refused_turn(exc, message, history)
            return
        yield from respond(message, history, session, settings, progress, sent_by_client=request is not None)


def stop(session: service.Session) -> None:
    session.stop_requested = True  # the answer ends after the current token, cleanly


def clear(session: service.Session) -> ChatOutputs:
    session.new_chat()
    return ChatOutputs([], EMPTY_INPUT, "", None, None, None, gr.Dropdown(choices=[overlay.MEAN], value=overlay.MEAN),
                       None, "")


def show_layer(session: service.Session, choice: str):
    return overlay.private(session, overlay.gallery(session.visuals, choice))


GENERAL_EXAMPLES = [("What shapes do you see, and what colour is each?", ["shapes.png"]),
                    ("Which bar is the tallest?", ["chart.png"]),
                    ("What differs between these two pictures?", ["shapes.png", "street.png"]),
                    ("Where does the ball go?", ["bouncing_ball.mp4"])]


def examples(model: str | None = None) -> list[list]:
    """The clickable examples for ``model`` (default: the model picked at start; present files only):
    the trained model's own (``service.arena_examples()``, each answered right, then its long video),
    else general ones for hub and random models."""
    model = service.default_model() if model is None else model
    rows = service.arena_examples() if service.is_trained_here(model) else GENERAL_EXAMPLES
    shown = [[{"text": text, "files": [str(ASSETS / f) for f in files]}] for text, files in rows
             if all((ASSETS / f).is_file() for f in files)]
    long = service.long_example() if service.is_trained_here(model) else None
    return shown + ([[{"text": long.question, "files": [long.path]}]] if long else [])


def example_settings(message) -> tuple:
    """The trained model's example clicked: how it is sent. Its long video streams every drawn frame
    under its KV cap; any other example goes in one prompt (no cap) with the model's frames."""
    long = service.long_example()
    files = message.get("files") if isinstance(message, dict) else None
    first = (files[0].get("path") if isinstance(files[0], dict) else files[0]) if files else None
    if long and first and Path(str(first)).name == Path(long.path).name:
        return long.stream_cap_mb, long.frames
    return 0, service.default_frames(service.ARENA)


def examples_label(model: str | None) -> str:
    """What the trained model's examples are, and how its long video is sent (said once, here)."""
    long = service.long_example() if model else None
    if not model:
        return "Examples (for hub models; random weights answer nonsense)"
    return ("Examples (made by the project, work offline" + (
        f"; the {long.seconds:.0f} s video streams under a {long.stream_cap_mb:g} MB KV cap" if long else "") + ")")


def show_examples(model: str) -> tuple:
    """Model picked: show the examples that work with it."""
    trained = service.is_trained_here(model)
    return gr.Column(visible=trained), gr.Column(visible=not trained)


@dataclass
class ChatTab:
    """The Chat tab's outputs (named as :class:`ChatOutputs`' fields)."""

    chatbot: gr.Chatbot
    textbox: gr.MultimodalTextbox
    status: gr.Markdown
    memory: gr.Plot
    speed: gr.Plot
    layers: gr.Plot
    layer_picker: gr.Dropdown
    gallery: gr.Gallery
    scale_line: gr.Markdown
    realised: gr.Markdown

    @property
    def outputs(self) -> list:
        return components_of(self, ChatOutputs)


def build_chat(settings: SettingsPanel, session: gr.State) -> ChatTab:
    # the conversation and the method that holds it side by side (on a phone the method right under
    # it): the switch the app is about is on the first screen, where its effect shows
    with gr.Row(elem_id="chat-row"):
        with gr.Column(scale=2, min_width=320, elem_id="conversation"):
            chatbot = checked_controls.Chatbot(label="Chat", height=300, elem_id="chatbot", buttons=["copy"],
                                 group_consecutive_messages=False,  # the new-conversation marker gets its own line
                                 placeholder="Attach images or a video, ask a question, and watch the panels below.")
            textbox = checked_controls.MultimodalTextbox(file_types=["image", "video"], file_count="multiple",
                                                         elem_id="chat-input", show_label=False, label="Message",
                                                         placeholder="Ask about your images or video…")
            status = gr.Markdown(elem_id="chat-status", label="Status")  # right under the input: what went wrong with it, or the figures
            with gr.Row():
                stop_button = gr.Button("Stop", variant="stop", size="sm", elem_id="stop")
                clear_button = gr.Button("New chat", size="sm", elem_id="new-chat")
        with gr.Column(scale=1, min_width=240, elem_id="method-column"):
            render_method_controls(settings)
    trained = service.is_trained_here(settings.model.value)
    example_sets = []
    for shown, model in ((trained, service.ARENA), (not trained, None)):  # one set per kind of model, one visible
        with gr.Column(visible=shown) as column:
            rows = examples(model or "")
            if rows:
                shown_examples = gr.Examples(rows, inputs=[textbox], label=examples_label(model), api_visibility="private")
                if model:  # a click also sets the stream cap and the frames the example is sent with
                    shown_examples.load_input_event.then(example_settings, textbox, [settings.stream_cap, settings.num_frames],
                                                         api_visibility="private")
        example_sets.append(column)
    with gr.Row():
        with gr.Column():
            memory = gr.Plot(label="KV memory", elem_id="memory-plot")
            scale = gr.Markdown(elem_id="scale-line", label="Computed at real scale")
        speed = gr.Plot(label="Speed", elem_id="speed-plot")
    layers = gr.Plot(label="Per-layer budget", elem_id="layer-plot")
    with gr.Row():
        picker = gr.Dropdown(choices=[overlay.MEAN], value=overlay.MEAN, label="Kept visual tokens at",
                             scale=1, elem_id="layer-picker")
        gr.Markdown("Clear cells: tokens the cache kept. Dark red: dropped (shaded by the share of heads "
                    "and layers that dropped them). With MPIC: clear = KV reused from the media store, "
                    "dark red = recomputed.")
    gallery = gr.Gallery(label="Which visual tokens were kept (mean over layers unless a layer is picked)", columns=3,
                         height="auto", object_fit="contain",
                         preview=False, fit_columns=False, elem_id="overlay")
    panels = media_library.build_media_panels()
    tab = ChatTab(chatbot, textbox, status, memory, speed, layers, picker, gallery, scale, settings.realised)
    settings.model.change(show_examples, settings.model, example_sets, api_visibility="private")

    event = api_docs.documented(by_component(tab, mcp_calls.own_session(submit)), "chat", CHAT_RETURNS)
    textbox.submit(event, [textbox, chatbot, session], tab.outputs, inputs_kwargs=settings.named,
                   api_name="chat", concurrency_id="gpu", concurrency_limit=1).success(
        by_component(panels, media_library.after_turn), [session, settings.method],
        components_of(panels, media_library.PanelOutputs), concurrency_id="gpu",
        api_visibility="private")
    stop_button.click(stop, session, None, api_visibility="private")
    clear_button.click(by_component(tab, clear), session, tab.outputs, api_visibility="private")
    picker.change(show_layer, [session, picker], gallery, api_visibility="private")
    return tab
