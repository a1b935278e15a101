"""The last tracebacks (security audit, item 10), each through a launched app as raw HTTP sends it:
a message file given as a URL (refused in one line, never downloaded: no name is even looked up),
"New scene" with an unknown kind, a POST to ``/run/predict``, and ``/call/chat`` or
``/queue/join`` with too few values. Each gets one line; the server's log holds no traceback."""

from __future__ import annotations

import socket
import uuid

import httpx
import pytest

from components.settings import control_names
from tests.app_support import launched_app
from tests.test_app_hostile import chat_data, file_data, fn_index, one_line, raw_event

NOWHERE = "kv-arena-audit.invalid"  # a host name the server must never look up


@pytest.fixture(scope="module")
def server():
    with launched_app() as launched:
        yield launched


@pytest.fixture
def looked_up(monkeypatch):
    """The host names this process resolves while the test runs (the server runs in it)."""
    names, real = [], socket.getaddrinfo

    def noted(host, *args, **kwargs):
        names.append(host.decode() if isinstance(host, bytes) else str(host))
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", noted)
    return names


@pytest.mark.parametrize("path", [f"http://{NOWHERE}/cat.png", f"https://{NOWHERE}/cat.png?x=1",
                                  "http://127.0.0.1:9/cat.png"])
@pytest.mark.parametrize("marked", [True, False], ids=["as gradio.FileData", "as a plain dict"])
def test_a_message_file_given_as_a_url_is_refused_without_a_download(server, path, marked, looked_up, capfd):
    demo, url = server
    sent = file_data(path) if marked else {"path": path, "orig_name": "cat.png"}
    message = raw_event(url, fn_index(demo, "chat"), chat_data({"text": "What is this?", "files": [sent]}),
                        uuid.uuid4().hex[:11])
    assert message["success"], message
    one_line(message["output"]["data"][2], "is a URL: this app does not download files")
    assert NOWHERE not in looked_up
    assert "Traceback" not in capfd.readouterr().err


def test_new_scene_with_an_unknown_kind_is_one_line(server, capfd):
    demo, url = server
    message = raw_event(url, fn_index(demo, "new_scene"), ["a dragon", None], uuid.uuid4().hex[:11])
    assert message["success"], message
    status = message["output"]["data"][-1]
    assert "The scene type must be one of" in status and "\n" not in status, status
    assert "Traceback" not in capfd.readouterr().err


def test_a_post_around_the_queue_is_one_line(server, capfd):
    demo, url = server
    for route in ("run/predict", "api/predict", "api/no-such-route", "api/chat/"):  # /api/<name>: Gradio's older name
        for body in ({"data": []}, {"data": ["colour", None], "fn_index": fn_index(demo, "new_scene")}):
            answer = httpx.post(f"{url}gradio_api/{route}", json=body, timeout=10)
            assert answer.status_code == 404, answer.text
            assert "goes through the queue" in answer.json()["detail"]
    assert "Traceback" not in capfd.readouterr().err
    example = next(i for i, fn in demo.fns.items() if fn.queue is False)  # an example's click, unqueued
    loaded = httpx.post(f"{url}gradio_api/run/predict", json={"data": [0], "fn_index": example,
                                                               "session_hash": uuid.uuid4().hex[:11]}, timeout=30)
    assert loaded.status_code != 404, loaded.text


def test_an_event_with_too_few_values_or_no_such_event_is_one_line(server, capfd):
    demo, url = server
    named = 2 + len(control_names())  # message, history, the settings (the tab's session is no parameter)
    for route, body, status, said in [
            ("call/chat", {"data": []}, 422, f'/chat takes {named} values in "data"'),
            ("call/compare", {"data": ["hi"]}, 422, "/compare takes"),
            ("call/predict", {"data": []}, 404, "no endpoint /predict"),
            ("queue/join", {"data": [], "fn_index": fn_index(demo, "chat"), "session_hash": "x1"}, 422,
             f"takes {named + 1} values"),
            ("queue/join", {"data": [], "fn_index": 9999, "session_hash": "x2"}, 404, "no event 9999")]:
        answer = httpx.post(f"{url}gradio_api/{route}", json=body, timeout=10)
        assert answer.status_code == status, (route, answer.text)
        line = answer.json()["detail"]
        assert said in line and "\n" not in line, (route, line)
    assert "Traceback" not in capfd.readouterr().err


def test_the_smaller_holes_of_issue_68_are_one_line(server, capfd):
    """An unknown endpoint names every endpoint; a lone surrogate anywhere in an event's values, a
    body nested 2,000 deep, or a follow-up that is not text are refused in one line, never queued."""
    import json

    from components import settings

    demo, url = server
    unknown = httpx.post(f"{url}gradio_api/call/nothing", json={"data": []}, timeout=10).json()["detail"]
    for name in ("/chat", "/compare", "/blind", "/vote", "/leaderboard"):
        assert name in unknown, unknown
    controls = settings.control_values(model="tiny-qwen2-vl", method="snapkv", max_new_tokens=4)
    model_at = control_names().index("model")
    lone = list(controls)
    lone[model_at] = "\ud800"
    blind_values = [{"text": "hi", "files": []}, "tiny-arena-vl", "random", "random", ""]
    for route, data in [("call/chat", [{"text": "hi", "files": []}, [], *lone]),
                        ("call/blind", [{"text": "hi", "files": []}, "tiny-arena-vl", "\ud800", "random", ""]),
                        ("call/blind", blind_values[:4] + ["\udfff"])]:
        answer = httpx.post(f"{url}gradio_api/{route}", content=json.dumps({"data": data}),
                            headers={"content-type": "application/json"}, timeout=10)
        assert answer.status_code == 422 and "lone surrogate" in answer.json()["detail"], (route, answer.text)
    deep = "[" * 2000 + "]" * 2000
    for route in ("call/chat", "queue/join"):
        answer = httpx.post(f"{url}gradio_api/{route}", content=f'{{"data": {deep}}}',
                            headers={"content-type": "application/json"}, timeout=10)
        assert answer.status_code == 400 and "nests deeper" in answer.json()["detail"], answer.text
    for follow_up in ("-1", "NaN", "[]", "true"):
        body = f'{{"data": [{{"text": "hi", "files": []}}, ["snapkv"], {follow_up}, {json.dumps(controls)[1:-1]}]}}'
        answer = httpx.post(f"{url}gradio_api/call/compare", content=body,
                            headers={"content-type": "application/json"}, timeout=10)
        assert answer.status_code == 422 and "takes text" in answer.json()["detail"], (follow_up, answer.text)
        assert "\n" not in answer.json()["detail"]
    assert "Traceback" not in capfd.readouterr().err


def test_too_deep_counts_nesting_outside_strings_and_skips_a_body_with_few_brackets():
    from components.event_shape import too_deep

    assert too_deep(b"[" * 3 + b"]" * 3, limit=2) and not too_deep(b"[[]]", limit=2)
    assert not too_deep(b'{"a": "' + b"[" * 10 + b'"}', limit=2)  # brackets inside a string do not nest
    assert not too_deep(b"[1, [2], [3], [4]]", limit=2)  # many brackets, none deeper than 2
