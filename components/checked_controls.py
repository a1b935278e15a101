"""Controls whose values the app checks itself, so a bad value sent through the API gets the
app's one-line message in the status line, as bad input in the browser does.

Gradio checks a Slider's range, a Number's type and a Dropdown's or CheckboxGroup's choices in
``preprocess``, before any event runs, and answers with its own error (and a traceback in the
server log; a value that is not a number even with no message at all). These subclasses hand the
value over as sent; the app checks it where it is used (``settings.checked``, a method's
``Param.coerce``, the model registry, ``service.compare``). They are drawn as their parent
(``is_template``); in the browser a slider still clamps what is typed into it.
"""

from __future__ import annotations

import gradio as gr


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


class CheckboxGroup(gr.CheckboxGroup):
    is_template = True

    def preprocess(self, payload):
        return payload
