"""What the app's event tests share: the settings and one chat event called directly, as the UI
calls it (their small media files are the ``media`` fixture, in conftest.py)."""

from __future__ import annotations

import socket
from contextlib import contextmanager

from components import chat, settings

MODEL = "tiny-qwen2-vl"


def config(method="streamingllm", **kw):
    return settings.settings_from(settings.control_values(model=kw.pop("model", MODEL), method=method,
                                                          max_new_tokens=kw.pop("max_new_tokens", 5), **kw))


def control_kwargs(*args, **kwargs) -> dict:
    """``settings.control_values`` by name (``settings.control_names``), as the API takes them."""
    return dict(zip(settings.control_names(), settings.control_values(*args, **kwargs)))


def turn(session, message, history=(), method="streamingllm", **kw):
    """All outputs of one chat event (``chat.ChatOutputs``), and the message it refused with (or None)."""
    outputs = list(chat.respond(message, list(history), session, config(method, **kw)))
    status = outputs[-1].status if outputs else ""
    return outputs, status if isinstance(status, str) and status.startswith(chat.NOT_ANSWERED) else None


def ask(text, *files):
    return {"text": text, "files": list(files)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def launched_app():
    """(demo, url) of the app launched in this process on a free port of 127.0.0.1, as ``python
    app.py`` launches it (the same limits and middleware); closed afterwards."""
    from app import build_demo, launch_options

    demo = build_demo()
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                            quiet=True, **launch_options())
    try:
        yield demo, url
    finally:
        demo.close()
