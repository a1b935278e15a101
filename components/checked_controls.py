"""Controls whose values the app checks itself, so a bad value sent through the API gets the
app's one-line message in the status line, as bad input in the browser does.

Gradio checks a Slider's range, a Number's type, a Dropdown's or CheckboxGroup's choices and a
MultimodalTextbox's file types in ``preprocess``, before any event runs, and answers with its own
error (and a traceback in the server log; a budget of "abc" even with no message at all). These
subclasses hand the value over as sent; the app checks it where it is used (``settings.checked``,
a method's ``Param.coerce``, the model registry, ``service.compare``, ``engine.media``). They are
drawn as their parent (``is_template``), so in the browser nothing changes: a slider still clamps
what is typed into it, the file picker still offers images and videos. (Subclasses, because
Gradio rebuilds a component from its class when an event updates it. Gradio writes a ``.pyi``
stub next to this module for them; it is generated and ignored by git.)
"""

from __future__ import annotations

from typing import Any

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages
from gradio.components.multimodal_textbox import MultimodalData
from pydantic import ValidationError, model_validator


class MalformedHistory(list):
    """A chat history that is not Gradio's messages format, handed over as sent (a list subclass,
    so :func:`components.chat.checked_history` refuses it by type, whatever it holds)."""


class _CheckedMessages(ChatbotDataMessages):
    """Gradio's messages format, but a history that does not fit it reaches ``preprocess`` (marked
    by ``root=None``, which the format never holds) instead of failing validation with a traceback."""

    @model_validator(mode="wrap")
    @classmethod
    def _keep_malformed(cls, value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            kept = cls.model_construct(root=None)
            kept.__dict__["sent"] = value
            return kept


class Chatbot(gr.Chatbot):
    is_template = True
    data_model = _CheckedMessages

    def preprocess(self, payload):
        if payload is not None and payload.root is None:  # malformed: the app says so in one line
            sent = payload.__dict__.get("sent")
            return MalformedHistory(sent if isinstance(sent, list) else [sent])
        return super().preprocess(payload)


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
        try:
            return handler(value)
        except ValidationError:
            kept = cls.model_construct(text=None, files=[])
            kept.__dict__["sent"] = value
            return kept


class MultimodalTextbox(gr.MultimodalTextbox):
    is_template = True
    data_model = _CheckedMultimodal

    def preprocess(self, payload):
        if payload is None:
            return None
        if payload.text is None:  # as sent: the app checks every part of it
            return payload.__dict__.get("sent")
        return {"text": payload.text, "files": [f.path for f in payload.files]}
