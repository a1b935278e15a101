"""Controls whose values the app checks itself, so a bad value sent through the API gets the
app's one-line message in the status line, as bad input in the browser does.

Gradio checks a Slider's range, a Number's type, a Dropdown's or CheckboxGroup's choices and a
MultimodalTextbox's file types in ``preprocess``, before any event runs, and answers with its own
error (and a traceback in the server log; a budget of "abc" even with no message at all). These
subclasses hand the value over as sent; the app checks it where it is used (``settings.checked``,
a method's ``Param.coerce``, the model registry, ``service.compare``, ``kv_arena.media``). They are
drawn as their parent (``is_template``), so in the browser nothing changes: a slider still clamps
what is typed into it, the file picker still offers images and videos. (Subclasses, because
Gradio rebuilds a component from its class when an event updates it. Gradio writes a ``.pyi``
stub next to this module for them; it is generated and ignored by git.)

``Chatbot`` and ``MultimodalTextbox`` also let a value that does not fit Gradio's format (a
malformed history or message sent through the API) reach the app as sent, which refuses it in one
line. ``Chatbot`` takes a history back as ``/chat`` returned it: gradio_client downloads each file of
the answer and hands back its own local path, which Gradio's chat model refuses before any event
runs. Such a block comes through marked ``RETURNED``; the chat puts the server's copy in its place.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages, ComponentMessage, FileMessage, Message, TextMessage
from gradio.components.multimodal_textbox import MultimodalData
from gradio.data_classes import GradioModel
from pydantic import ValidationError, model_validator

RETURNED = "returned"  # marks a file block whose path is a client's download, not a file of this server


class ReturnedFile(GradioModel):
    """A file block as gradio_client hands a history back: ``file`` is the path of its own download."""

    file: str
    alt_text: str | None = None
    type: Literal["file"] = "file"


class _Message(Message):
    content: list[Union[TextMessage, FileMessage, ReturnedFile, ComponentMessage]]


def _kept_as_sent(cls, value: Any, handler, **marker):
    """``value`` validated by ``handler``; one that does not fit the format is kept as sent (in the
    model's ``__dict__["sent"]``), in a model built with ``marker`` fields the format never holds,
    so ``preprocess`` hands it to the app, which refuses it in one line."""
    try:
        return handler(value)
    except ValidationError:
        kept = cls.model_construct(**marker)
        kept.__dict__["sent"] = value
        return kept


class MalformedHistory(list):
    """A chat history that is not Gradio's messages format, handed over as sent (a list subclass,
    so :func:`components.chat.checked_history` refuses it by type, whatever it holds)."""


class _History(ChatbotDataMessages):
    """Gradio's messages format with returned files; a history that does not fit it reaches
    ``preprocess`` (marked by ``root=None``, which the format never holds) instead of failing
    validation with a traceback."""

    root: list[_Message]

    @model_validator(mode="wrap")
    @classmethod
    def _keep_malformed(cls, value: Any, handler):
        return _kept_as_sent(cls, value, handler, root=None)


def self_contained(schema: dict) -> dict:
    """``schema`` with each ``#/$defs/`` reference replaced by its definition. Gradio nests a
    component's ``$defs`` inside its parameter's schema, where a validator that resolves references
    from the root (an MCP server's, checking a tool's arguments) cannot find them."""
    defs = schema.get("$defs", {})

    def inline(node):
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):  # the definition, with what the reference adds (a default)
            return inline(defs[ref.removeprefix("#/$defs/")] | {k: v for k, v in node.items() if k != "$ref"})
        return {key: inline(value) for key, value in node.items() if key != "$defs"}

    return inline(schema)


class Chatbot(gr.Chatbot):
    is_template = True
    data_model = _History

    def api_info(self) -> dict:
        return self_contained(super().api_info())

    def preprocess(self, payload):
        if payload is not None and payload.root is None:  # malformed: the app says so in one line
            sent = payload.__dict__.get("sent")
            return MalformedHistory(sent if isinstance(sent, list) else [sent])
        return super().preprocess(payload)

    def _preprocess_content(self, chat_message):
        if isinstance(chat_message, ReturnedFile):  # never read: the chat maps it to its own copy
            return {"type": "file", "file": {"path": chat_message.file}, "alt_text": chat_message.alt_text,
                    RETURNED: True}
        return super()._preprocess_content(chat_message)


class Slider(gr.Slider):
    is_template = True

    def preprocess(self, payload):
        return payload


class Number(gr.Number):
    is_template = True

    def preprocess(self, payload):
        return payload


class Dropdown(gr.Dropdown):
    is_template = True

    def preprocess(self, payload):
        return payload


class Radio(gr.Radio):
    is_template = True

    def preprocess(self, payload):
        return payload


class CheckboxGroup(gr.CheckboxGroup):
    is_template = True

    def preprocess(self, payload):
        return payload


class _CheckedMultimodal(MultimodalData):
    """Gradio's message format, but a message that does not fit it (a file without Gradio's marker,
    text that is no string) reaches ``preprocess`` as sent (marked by ``text=None``), where the app
    refuses it in one line (``chat.parse_message``, ``service.check_sent_files``)."""

    @model_validator(mode="wrap")
    @classmethod
    def _keep_malformed(cls, value: Any, handler):
        return _kept_as_sent(cls, value, handler, text=None, files=[])


class MultimodalTextbox(gr.MultimodalTextbox):
    is_template = True
    data_model = _CheckedMultimodal

    def api_info(self) -> dict:
        return self_contained(super().api_info())

    def preprocess(self, payload):
        if payload is None:
            return None
        if payload.text is None:  # as sent: the app checks every part of it
            return payload.__dict__.get("sent")
        return {"text": payload.text, "files": [f.path for f in payload.files]}
