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

``Chatbot`` takes a history back as ``/chat`` returned it: gradio_client downloads each file of
the answer and hands back its own local path, which Gradio's chat model refuses before any event
runs. Such a block comes through marked ``RETURNED``; the chat puts the server's copy in its place.
"""

from __future__ import annotations

from typing import Literal, Union

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages, ComponentMessage, FileMessage, Message, TextMessage
from gradio.data_classes import GradioModel

RETURNED = "returned"  # marks a file block whose path is a client's download, not a file of this server


class ReturnedFile(GradioModel):
    """A file block as gradio_client hands a history back: ``file`` is the path of its own download."""

    file: str
    alt_text: str | None = None
    type: Literal["file"] = "file"


class _Message(Message):
    content: list[Union[TextMessage, FileMessage, ReturnedFile, ComponentMessage]]


class _History(ChatbotDataMessages):
    root: list[_Message]


class Chatbot(gr.Chatbot):
    is_template = True
    data_model = _History

    def _preprocess_content(self, chat_message):
        if isinstance(chat_message, ReturnedFile):  # never read: the chat maps it to its own copy
            return {"type": "file", "file": {"path": chat_message.file}, "alt_text": chat_message.alt_text, RETURNED: True}
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


class MultimodalTextbox(gr.MultimodalTextbox):
    is_template = True

    def preprocess(self, payload):
        return None if payload is None else {"text": payload.text, "files": [f.path for f in payload.files]}
