"""Bad input through the public API, as a careless or hostile client sends it: broken, empty,
huge, animated and mislabelled files, a message of 100,000 characters, a 900 s video, values out of
range or not numbers, unknown methods and models, a hub model with no network, another client's
upload, too many methods to compare.

For each: the reply is one line of the app's own (the status line under the input), the chat
history comes back as sent, the server logs one line and no traceback, and the conversation goes
on afterwards (the last test continues it). One server and one client for the module."""

from __future__ import annotations

import logging
import re

import gradio_client.client
import huggingface_hub.constants
import pytest
from PIL import Image
from tests.support import make_image, write_mjpeg_avi
from tests.test_app_client import controls, send, url  # noqa: F401 - ``url``: the module's server
from gradio_client import Client, handle_file

from components.chat import NOT_ANSWERED, transcript
from components.compare import SLOTS
from kv_arena import service

HUB_MODEL = "Qwen/Qwen2-VL-2B-Instruct"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    paths = {name: root / name for name in ("broken.png", "empty.png", "notes.mp4", "notes.txt", "long.avi",
                                            "huge.png", "moving.gif", "good.png", "theirs.png", "garbled.avi")}
    paths["broken.png"].write_bytes(b"\x89PNG\r\n\x1a\n not a picture after all")
    paths["empty.png"].write_bytes(b"")
    paths["notes.mp4"].write_text("plain text, not a video")
    paths["notes.txt"].write_text("plain text")
    write_mjpeg_avi(paths["long.avi"], [Image.new("RGB", (32, 32), (8 * i, 0, 0)) for i in range(30)], 30)
    Image.new("RGB", (8000, 8000), "white").save(paths["huge.png"])  # 64 M pixels in a small file
    frames = [Image.new("RGB", (64, 64), colour) for colour in ("red", "green", "blue")]
    frames[0].save(paths["moving.gif"], save_all=True, append_images=frames[1:], duration=100, loop=0)
    make_image(11, (112, 112)).save(paths["good.png"])
    make_image(12, (112, 112)).save(paths["theirs.png"])
    write_garbled_avi(paths["garbled.avi"])
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def chat(url, files):  # noqa: F811
    """One client and the history of its first, good turn, which every bad input must leave as it was."""
    client = Client(url, verbose=False)
    final, _ = send(client, "What is in the picture?", [files["good.png"]])
    assert final[0][-1]["role"] == "assistant" and not final[2].startswith(NOT_ANSWERED)
    return client, final[0]


@pytest.fixture(scope="module")
def theirs(url, files):  # noqa: F811
    """The server path of a picture another client uploaded (and that client, whose session must
    stay open for the file to stay)."""
    other = Client(url, verbose=False)
    send(other, "Mine.", [files["theirs.png"]])
    (path,) = service.open_session(other.session_hash).uploads
    return path, other


def write_garbled_avi(path) -> None:
    """An AVI whose container and first frame are sound and whose other frames are noise: it opens,
    its frames do not decode."""
    write_mjpeg_avi(path, [Image.new("RGB", (64, 64), (40 * i, 0, 0)) for i in range(4)], 1)
    data = bytearray(path.read_bytes())
    at, index = data.find(b"00dc", data.find(b"movi")), 0
    while at >= 0:
        size = int.from_bytes(data[at + 4:at + 8], "little")
        if index:
            data[at + 8:at + 8 + size] = b"\x55" * size
        at, index = data.find(b"00dc", at + 8 + size), index + 1
    path.write_bytes(bytes(data))


def offline(monkeypatch, tmp_path) -> None:
    """No network and nothing downloaded before."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))


def skip_upload(monkeypatch, tmp_path) -> None:
    """A client that names a server path instead of uploading the bytes."""
    monkeypatch.setattr(gradio_client.client.Endpoint, "_upload_file",
                        lambda self, f, data_index: {"path": f["path"], "meta": {"_type": "gradio.FileData"}})


# (what, message text, attached files (names in ``files``, or "theirs"), settings, expected words, set-up)
CHAT_CASES = [
    ("a corrupt image", "What is this?", ["broken.png"], {}, "is not a readable image", None),
    ("an empty image", "What is this?", ["empty.png"], {}, "is not a readable image", None),
    ("a text file named .mp4", "What happens?", ["notes.mp4"], {}, "is not a video that can be decoded", None),
    ("a text file", "What is this?", ["notes.txt"], {}, "is not a readable image", None),
    ("a 100,000-character prompt", "why " * 25_000, [], {}, "The message is too long", None),
    ("a 900 s video", "What happens?", ["long.avi"], {}, "lasts 900 s; the limit is 600 s", None),
    ("8000 x 8000 pixels", "What is this?", ["huge.png"], {}, "8000 x 8000 pixels; the limit is 25 million", None),
    ("an animated GIF", "What moves?", ["moving.gif"], {}, "is an animation of 3 frames", None),
    ("an empty message", "   ", [], {}, "The message is empty", None),
    ("budget 5", "Again?", [], {"budget": 5}, "The budget must lie between 0.01 and 1; got 5", None),
    ("budget -1", "Again?", [], {"budget": -1}, "The budget must lie between 0.01 and 1; got -1", None),
    ("budget 0", "Again?", [], {"budget": 0}, "The budget must lie between 0.01 and 1; got 0", None),
    ("budget 'abc'", "Again?", [], {"budget": "abc"}, "The budget must be a number from 0.01 to 1; got 'abc'", None),
    ("1000 video frames", "Again?", [], {"num_frames": 1000}, "Video frames must lie between 1 and 32", None),
    ("100000 new tokens", "Again?", [], {"max_new_tokens": 100_000}, "Max new tokens must lie between 1 and 512", None),
    ("a memory cap of -1 MB", "Again?", [], {"stream_cap_mb": -1}, "The memory cap (MB) must lie between 0 and 65536", None),
    ("a memory cap 'lots'", "Again?", [], {"stream_cap_mb": "lots"}, "The memory cap (MB) must be a number", None),
    ("2000 frames streamed", "Again?", [], {"num_frames": 2000, "stream_cap_mb": 2},
     "Video frames must lie between 1 and 1024", None),
    ("a cap for a method that cannot hold one", "Again?", [], {"method": "h2o", "stream_cap_mb": 2},
     "H2O (heavy hitters) cannot stream a video under a memory cap", None),
    ("a method parameter out of range", "Again?", [], {"streamingllm_sink_tokens": -5},
     "parameter 'sink_tokens' must lie in", None),
    ("an unknown method", "Again?", [], {"method": "lossless_magic"}, "unknown method 'lossless_magic'", None),
    ("an unknown model", "Again?", [], {"model": "gpt-vision-9"}, "unknown model 'gpt-vision-9'", None),
    ("a hub model with no network", "Again?", [], {"model": HUB_MODEL},
     f"{HUB_MODEL} must be downloaded from the Hugging Face Hub, which this server cannot reach", offline),
    ("another client's upload", "Whose is this?", ["theirs"], {}, "was not uploaded in this session", skip_upload),
    ("an AVI whose frames do not decode", "What happens?", ["garbled.avi"], {}, "has frames that cannot be decoded",
     None),
    ("Infinity for an int knob", "Again?", [], {"max_new_tokens": "Infinity"}, "Max new tokens must be a number", None),
    ("Infinity for a method's int knob", "Again?", [], {"streamingllm_sink_tokens": "Infinity"},
     "expects a finite int", None),
    ("NaN for a method's float knob", "Again?", [], {"method": "h2o", "h2o_recent_share": "NaN"},
     "expects a finite float", None),
    ("2.5 for an int knob", "Again?", [], {"streamingllm_sink_tokens": 2.5}, "expects a whole number", None),
    ("the method as a list", "Again?", [], {"method": ["snapkv"]}, "The method must be a name (text)", None),
    ("the method as a dict", "Again?", [], {"method": {"name": "snapkv"}}, "The method must be a name (text)", None),
    ("the model as a list", "Again?", [], {"model": ["tiny-qwen2-vl"]}, "The model must be a name (text)", None),
    ("the model as a dict", "Again?", [], {"model": {"a": 1}}, "The model must be a name (text)", None),
    ("a random: architecture", "Again?", [], {"model": "random:Qwen/Qwen2.5-VL-7B-Instruct"},
     "is not offered on this server", None),
    ("a file outside the upload folder", "Whose is this?", ["/etc/hostname"], {}, "was not uploaded to this app",
     skip_upload),
]


def one_refusal(status: str, expected: str) -> None:
    assert status.startswith(NOT_ANSWERED) and expected in status, status
    assert "\n" not in status and "Traceback" not in status  # one line, the app's own
    assert not re.search(r"\(\w*(?:Error|Exception)\)", status), status  # words, not a Python class name


def user_error_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("user error:")]


@pytest.mark.parametrize("what, text, attached, settings, expected, setup", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_input_is_one_line_and_the_chat_stays(chat, files, theirs, what, text, attached, settings,
                                                       expected, setup, monkeypatch, tmp_path, caplog, capfd):
    client, history = chat
    if setup is not None:
        setup(monkeypatch, tmp_path)
    caplog.set_level(logging.INFO, logger="components")
    paths = [theirs[0] if name == "theirs" else files.get(name, name) for name in attached]
    job = client.submit(message={"text": text, "files": [handle_file(p) for p in paths]}, history=history,
                        **(controls() | settings), api_name="/chat")
    final = job.result(timeout=120)
    one_refusal(final[2], expected)
    assert transcript(final[0]) == transcript(history)  # the chat as it was sent
    assert len(user_error_lines(caplog)) == 1  # the server's log: one line
    assert "Traceback" not in capfd.readouterr().err


COMPARE_CASES = [
    ("five methods", ["streamingllm", "h2o", "snapkv", "pyramidkv", "vl_cache"], {}, "Pick 1 to 4 methods"),
    ("an unknown method", ["streamingllm", "lossless_magic"], {}, "unknown method 'lossless_magic'"),
    ("no method", [], {}, "Pick 1 to 4 methods"),
    ("Compare's budget out of range", ["snapkv"], {"budget": 5}, "The budget must lie between"),
    ("an unknown time of compression", ["snapkv"], {"compress": "later"}, "When the cache is compressed must be one of"),
]


@pytest.mark.parametrize("what, methods, settings, expected", COMPARE_CASES, ids=[c[0] for c in COMPARE_CASES])
def test_bad_comparisons_are_one_line(chat, files, what, methods, settings, expected, caplog, capfd):
    client, _ = chat
    caplog.set_level(logging.INFO, logger="components")
    result = client.predict(message={"text": "Describe.", "files": [handle_file(files["good.png"])]},
                            methods=methods, **(controls() | settings), api_name="/compare")
    one_refusal(result[SLOTS + 1], expected)
    assert len(user_error_lines(caplog)) == 1
    assert "Traceback" not in capfd.readouterr().err


def test_after_all_that_the_conversation_goes_on(chat):
    """Every refusal above left the session's conversation alone: the next message continues it."""
    client, history = chat
    final, _ = send(client, "And the colours?", history=history)
    assert not final[2].startswith(NOT_ANSWERED)
    assert len(final[0]) == len(history) + 2 and transcript(final[0])[:-1] == transcript(history)
    assert not any((m.get("metadata") or {}).get("title") for m in final[0])  # no new-conversation marker


def test_a_message_over_the_text_limits_stays_in_the_box_to_be_shortened():
    from components import chat as chat_tab

    long = "why " * 6_250  # 25,000 characters: refused, and kept where the visitor can shorten it
    assert chat_tab.box_as_sent({"text": long, "files": []})["text"] == long
    assert chat_tab.box_as_sent({"text": "\ud800", "files": []}) == chat_tab.EMPTY_INPUT  # cannot be sent back
