"""The Chat tab: a multi-turn chat with images and videos, streamed token by token, with live
panels (KV memory, speed, per-layer budget) and the kept-visual-token overlay.

:func:`respond` is the event's logic with plain arguments (tests call it directly), yielding
:class:`ChatOutputs`; :func:`submit` is the event, with the settings column's values, wired to
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

from . import api_docs, at_scale, checked_controls, clients, mcp_calls, media_library, overlay, plots
from .outputs import KEEP, Outputs, by_component, components_of
from .plots import Drawn, fmt_bytes
from .settings import SettingsPanel, realised_note, settings_from_named

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


def parse_message(message: dict | str | None) -> tuple[str, list[str]]:
    """MultimodalTextbox value -> (text, file paths); a value of another shape, or text that is not
    valid Unicode (a lone surrogate), is a UserError."""
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
    return service.checked_text(text), files


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
        text, _ = _said(message.get("content"))
        service.checked_text(text)
    return history


def refused_turn(exc: UserError, message, history) -> ChatOutputs:
    """A turn refused before it started: the chat and the message back as sent where they can be
    shown (a malformed one is left as it was), the reason under them."""
    return ChatOutputs(chatbot=shown_or(history, checked_history, KEEP), status=refusal(exc), textbox=box_as_sent(message))


def box_as_sent(message) -> dict:
    """The input box as a refused message left it: its text and its files where they can be shown
    (a file from outside the upload folder cannot: Gradio would not serve it), else empty."""
    try:
        text, files = parse_message(message)
    except UserError:
        return EMPTY_INPUT
    return {"text": text, "files": shown_or(files, service.check_sent_files, [])}


NEW_CONVERSATION = "New conversation"  # the title of the marker a new conversation gets in the chat
SWITCHED = "Method switched"  # the title of the line a conversation re-read by another method gets
WHY_NEW = {"model": "The model changed, so this is a new conversation: the messages above are not in its memory.",
           "history": "The history sent is not the conversation this session's model holds (it was edited, or "
                      "the cache was freed), so this is a new conversation: the messages above are not in its memory."}


def _said(content) -> tuple[str, int]:
    """A chat message's (text, attached files), whatever form Gradio or a client gives it in."""
    blocks = content if isinstance(content, list) else [content]
    text, files = [], 0
    for block in blocks:
        if isinstance(block, str):
            text.append(block)
        elif isinstance(block, dict) and (block.get("type") == "text" or "text" in block):
            text.append(block.get("text") or "")
        elif block is not None:
            files += 1  # {"path": ...}, {"type": "file", ...}, a component
    return " ".join(text).strip(), files


def transcript(history: list) -> list[tuple[str, int, str]]:
    """(question, attachments, answer) of each turn a chat shows since its last new-conversation
    marker: what the model must remember for a message sent after it to continue its conversation."""
    turns, question, files = [], [], 0
    for message in history or []:
        title = (message.get("metadata") or {}).get("title")
        if title == NEW_CONVERSATION:
            turns, question, files = [], [], 0
            continue
        if title == SWITCHED:  # the same conversation, held by another method from here on
            continue
        text, attached = _said(message.get("content"))
        if message.get("role") == "user":
            question.append(text)
            files += attached
        else:
            turns.append((" ".join(t for t in question if t), files, "" if text == "…" else text))
            question, files = [], 0
    return turns


def with_own_files(history: list, session: service.Session) -> list:
    """A history sent back as ``/chat`` returned it: each file block gradio_client downloaded
    (``checked_controls.RETURNED``, a path of the client's) becomes this server's copy, matched from
    the newest file of the session's conversation backwards; one the conversation no longer holds
    becomes a line saying so (it is before the conversation's start, so the transcript is unchanged)."""
    own = [f for p in session.history for f in p.files]
    out = []
    for message in reversed(history):
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get(checked_controls.RETURNED) for b in content):
            blocks = []
            for block in reversed(content):
                if isinstance(block, dict) and block.get(checked_controls.RETURNED):
                    block = {"type": "file", "file": {"path": own.pop()}} if own else {"type": "text", "text": "(a file)"}
                blocks.append(block)
            message = message | {"content": blocks[::-1]}
        out.append(message)
    return out[::-1]


def method_title(name: str) -> str:
    """A method's title; its name when unknown (the turn then refuses it in one line)."""
    try:
        return service.method_spec(name)["title"]
    except ValueError:
        return name


def switch_line(text: str) -> dict:
    return {"role": "assistant", "content": text, "metadata": {"title": SWITCHED}}


def switched(note: service.SwitchNote) -> str:
    """The chat's line for a conversation another method took over, with what the re-read cost."""
    turns = f"{note.turns} turn{'s' if note.turns != 1 else ''}"
    return (f"Now held by {note.method}: it re-read the {turns} above ({note.tokens} tokens, {note.seconds:.2f} s), "
            "so the next answers come from its cache.")


def user_messages(text: str, files: list[str]) -> list[dict]:
    content = [{"path": f} for f in files] + ([text] if text else [])
    return [{"role": "user", "content": content}]


def reference_run(view: service.ChatView) -> Drawn | None:
    """The full cache's answer as the panels draw it (None for the full cache itself)."""
    ref = view.reference
    return Drawn("Full cache", ref.metrics, ref.layers, ref.cached) if ref else None


def status_line(view: service.ChatView, settings: service.Settings, with_media: bool = False) -> str:
    """One line of figures under the chat, in words (``with_media``: the message carried images or
    a video), and under it any :func:`explanation`."""
    m, ref = view.metrics, view.reference
    parts = [f"**{view.method}**", f"{m.new_tokens} new tokens", f"KV cache {fmt_bytes(m.kv_bytes)}"]
    if ref:
        full = ref.metrics.kv_trace
        same_point = full[min(len(m.kv_trace) - 1, len(full) - 1)]
        parts[-1] += f" vs {fmt_bytes(same_point)} full ({1 - m.kv_bytes / same_point:.0%} saved)"
        parts.append(f"after the prompt it held {plots.kept_fraction(view, ref):.2f}x of the full KV")
    if view.stream:
        parts.append(stream_line(view.stream, settings.num_frames))
    parts += [f"first token after {m.ttft_s:.2f} s", f"{m.decode_tok_s:.1f} tokens/s"]
    if view.right is not None:
        parts.append("✓ **right**" if view.right else f"✗ **wrong** (true: {view.truth})")
    if view.agreement is not None:
        parts.append(f"{view.agreement:.0%} of its answer tokens match the full cache's")
    if view.done:
        parts.append(model_time(m, ref))
    if ref and ref.cached:
        parts.append("full-cache figures reused from an earlier run on this input (cached)")
    if view.mpic:
        parts.append(mpic_line(view.mpic))
    if service.has_random_weights(settings.model):
        parts.append("random weights: the text is nonsense, the figures are real")
    line = " · ".join(parts)
    why = explanation(view, settings, with_media)
    return line + (f"\n\n{why}" if why else "")


def explanation(view: service.ChatView, settings: service.Settings, with_media: bool) -> str:
    """One line beside an answer whose figures would mislead without it: right although the method
    dropped part of the picture (the first word comes from the prompt's pass, before the method
    compresses), or holding more than its budget."""
    ref = view.reference
    if not view.done or ref is None:
        return ""
    held = plots.kept_fraction(view, ref)
    lines = []
    if view.right and with_media and settings.question_after is False and held is not None and held < 0.99:
        lines.append(f"*Why right although {view.method} dropped part of the picture:* the first word is chosen at the "
                     "end of the prompt's pass, before the method compresses. Ask a follow-up about another object, "
                     "or pick \"Before the question\", to see what it dropped.")
    uses_budget = service.method_spec(settings.method)["uses_budget"]
    if uses_budget and held is not None and held > settings.budget + 0.05:
        lines.append(f"*Why {held:.2f}x with a budget of {settings.budget:.2f}:* on a prompt this short, what "
                     f"{view.method} never evicts (its window of recent tokens, sinks, the text) is more than the "
                     "budget; on a longer prompt it holds its budget.")
    return "\n\n".join(lines)


def stream_line(stream: service.StreamView, asked: int | None = None) -> str:
    """How the media streamed in: frames (and why fewer than the ``asked`` of the slider), chunks,
    the cap and the most the cache held meanwhile."""
    line = f"streamed {stream.frames_total} frames in {len(stream.frames)} chunks"
    if asked and stream.frames_total < asked:
        line += f" (all the media have: the slider asked for {asked})"
    peak = fmt_bytes(max(stream.peak_kv_bytes, default=0))
    if stream.capped:
        return line + f" under a cap of {fmt_bytes(stream.cap_bytes)} (at most {peak} while a chunk went in)"
    return line + f" without a cap (up to {peak})"


def model_time(metrics: service.Meters, reference: service.ReferenceView | None) -> str:
    """The model's own time for this message (first token and decode), and the full-cache
    reference's when it was computed now: what the wait was made of, besides the app."""
    line = f"model time {metrics.ttft_s + metrics.decode_s:.3f} s"
    if reference and not reference.cached:
        line += f" + {reference.metrics.ttft_s + reference.metrics.decode_s:.3f} s for the full-cache reference"
    return line


def mpic_line(reuse: service.ReuseSummary) -> str:
    """What MPIC reused from the store for this prompt, and any image it had to recompute."""
    line = f"{reuse.mode}: {reuse.reused} prompt tokens reused from the media store, {reuse.recomputed} computed"
    # a stored image the linker could not use says why ("recomputed (not stored)", a damaged file...)
    missed = [f"image/video {i + 1} {why}" for i, why in enumerate(reuse.visuals) if why.startswith("recomputed (")]
    if missed:
        line += " (" + "; ".join(missed) + ")"
    if reuse.note:
        line += f"; {reuse.note}"
    return line


def panels(view: service.ChatView) -> tuple:
    """The memory, speed and layer panels."""
    run, ref = Drawn(view.method, view.metrics, view.layers, stream=view.stream), reference_run(view)
    return plots.memory_figure([run], ref), plots.speed_figure([run], ref), plots.layer_figure([run], ref)


def measured(view: service.ChatView) -> tuple[str, str | None]:
    """The line under the memory panel (computed at real scale) and the settings column's note on
    what the method really held (both from the fraction measured after the prompt; None: nothing
    measured)."""
    if view.reference is None and not view.is_reference:
        return "", no_reference_note(view)
    fraction = 1.0 if view.is_reference else plots.kept_fraction(view, view.reference)
    return (at_scale.scale_line(view.method, fraction, view.metrics.prompt_tokens),
            realised_note(view.method, fraction))


def no_reference_note(view: service.ChatView) -> str:
    """Why a chat has no "vs full" figure (its video is longer than one prompt: the full cache's
    answer would prefill it all at once), and the full cache's bytes computed against the cap."""
    line = ("**No full-cache reference** for this chat: its video is longer than one prompt holds, and the full "
            "cache's answer would prefill all of it at once, which is what streaming under a cap avoids.")
    stream = view.stream
    if stream and stream.full_kv_bytes:
        cap = f" against the cap of {fmt_bytes(stream.cap_bytes)}" if stream.cap_bytes else ""
        line += (f" *Computed:* a full cache would hold {fmt_bytes(stream.full_kv_bytes)} after the media{cap}; "
                 f"{view.method} held {fmt_bytes(view.metrics.kv_bytes_prefill)} after the question.")
    return line


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
            progress=None) -> Iterator[ChatOutputs]:
    """Answer one message: the chat, the panels, the kept-token overlay and the notes as it streams.
    Bad input is said once, in the status line under the input: the chat and the panels keep what
    they showed, the rejected files leave the input box (the text stays)."""
    try:
        history, (text, files) = list(checked_history(history)), parse_message(message)
    except UserError as exc:
        yield refused_turn(exc, message, history)
        return
    history = with_own_files(history, session)
    try:
        service.check_uploads(session, files)
        prepared = service.prepare(text, files, settings.num_frames, progress_reporter(progress))
    except UserError as exc:
        yield ChatOutputs(chatbot=history, textbox={"text": text, "files": []}, status=refusal(exc))
        return
    shown, turns = history, transcript(history)
    fate = session.fate(settings, turns)  # the history sent is the conversation, or a new one starts
    if history and fate in WHY_NEW:
        shown = shown + [{"role": "assistant", "content": WHY_NEW[fate], "metadata": {"title": NEW_CONVERSATION}}]
    switch_at = None
    if fate == "switches":  # said where it happens; its cost filled in once the re-read is done
        switch_at, shown = len(shown), shown + [switch_line(f"{method_title(settings.method)} re-reads the conversation…")]
    shown = shown + user_messages(text, files)
    answer = {"role": "assistant", "content": "…"}
    # the panels empty while it works (plain values: cheaper for Gradio than leaving them as they are)
    yield ChatOutputs(shown + [answer], EMPTY_INPUT, "Working…", memory=None, speed=None, layers=None,
                      layer_picker=overlay.MEAN, gallery=None, scale_line="")
    hint = service.media_hint(settings.model, (session.history if fate in ("continues", "switches") else []) + [prepared])
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
                shown = shown[:switch_at] + [switch_line(switched(view.switch))] + shown[switch_at + 1:]
                switch_at = None
            status = status_line(view, settings, bool(files)) + (f"\n\n{hint}" if hint else "")
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
    service.track(session, session_hash, clients.client_of(request))
    with service.active(session_hash):  # a session answering is not idle, however long it takes
        try:
            checked_history(history)
            if request is not None:  # from a client (a direct call, as the tests make, may name any file)
                service.check_sent_files(parse_message(message)[1])
            settings = settings_from_named(controls)
        except UserError as exc:  # the chat and the message as they were, the reason under them
            yield refused_turn(exc, message, history)
            return
        yield from respond(message, history, session, settings, progress)


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
    the trained model's own (``service.ARENA_EXAMPLES``, each answered right), else general ones
    for hub and random models."""
    model = service.default_model() if model is None else model
    rows = service.ARENA_EXAMPLES if service.is_trained_here(model) else GENERAL_EXAMPLES
    return [[{"text": text, "files": [str(ASSETS / f) for f in files]}] for text, files in rows
            if all((ASSETS / f).is_file() for f in files)]


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
    # 300 px: at 1280 x 800 the examples sit above the fold, under the input
    chatbot = checked_controls.Chatbot(label="Chat", height=300, elem_id="chatbot", buttons=["copy"],
                         group_consecutive_messages=False,  # the new-conversation marker gets its own line
                         placeholder="Attach images or a video, ask a question, and watch the panels below.")
    textbox = checked_controls.MultimodalTextbox(file_types=["image", "video"], file_count="multiple",
                                                 elem_id="chat-input", show_label=False, label="Message",
                                                 placeholder="Ask about your images or video…")
    status = gr.Markdown(elem_id="chat-status", label="Status")  # right under the input: what went wrong with it, or the figures
    trained = service.is_trained_here(settings.model.value)
    example_sets = []
    for shown, model in ((trained, service.ARENA), (not trained, None)):  # one set per kind of model, one visible
        with gr.Column(visible=shown) as column:
            rows = examples(model or "")
            if rows:
                gr.Examples(rows, inputs=[textbox], label="Examples (made by the project, work offline)"
                            if model else "Examples (for hub models; random weights answer nonsense)",
                            api_visibility="private")
        example_sets.append(column)
    with gr.Row():
        stop_button = gr.Button("Stop", variant="stop", size="sm", elem_id="stop")
        clear_button = gr.Button("New chat", size="sm", elem_id="new-chat")
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
