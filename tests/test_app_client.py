"""The launched app driven through gradio_client: a full chat turn with an image upload, streaming,
errors as messages, per-client isolation (sessions and uploads), the named endpoints ``/chat`` and
``/compare`` called with named parameters, and ``python app.py`` honouring GRADIO_SERVER_*."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
from tests.app_support import control_kwargs, free_port, launched_app
from tests.support import make_image
import gradio_client.client
from gradio_client import Client, handle_file

from components.chat import NEW_CONVERSATION, NOT_ANSWERED
from components.history import REREAD
from kv_arena import service

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def url():
    with launched_app() as (_, address):
        yield address


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("client") / "small.png"
    make_image(3, (112, 112)).save(path)
    return str(path)


def controls(**kw):
    return control_kwargs(model=MODEL, method="streamingllm", max_new_tokens=kw.pop("max_new_tokens", 5), **kw)


def send(client: Client, text: str, files=(), history=(), **settings):
    """One /chat call; ``history`` exactly as the previous call returned it (its files are the
    client's downloads: the server puts its own copies in their place)."""
    job = client.submit(message={"text": text, "files": [handle_file(f) for f in files]}, history=list(history),
                        **(controls() | settings), api_name="/chat")
    final = job.result(timeout=120)
    return final, job.outputs()


def test_chat_turn_with_an_image_upload(url, image):
    client = Client(url, verbose=False)
    final, outputs = send(client, "What is in the picture?", [image])
    history, box, status, memory, speed, layers, picker, gallery, scale, realised = final
    assert len(outputs) >= 2  # streamed: the echo, then the answer (its text at most every chat.TEXT_EVERY_S)
    assert history[0]["role"] == "user" and history[-1]["role"] == "assistant"
    assert any(block.get("type") == "file" for block in history[0]["content"])  # the upload is in the chat
    assert "saved" in status and "StreamingLLM" in status
    assert memory and speed and layers and len(gallery) == 1
    assert scale.startswith("*Computed, not measured:*") and "Measured after the prompt" in realised
    # a second turn in the same session continues the same conversation
    final, _ = send(client, "And the colours?", history=history)
    assert len(final[0]) == len(history) + 2


def test_bad_input_is_a_message_and_the_app_keeps_serving(url, image, tmp_path):
    client = Client(url, verbose=False)
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(b"not a png at all")
    final, _ = send(client, "What is this?", [str(corrupt)])
    assert final[2].startswith(NOT_ANSWERED) and "is not a readable image" in final[2]
    assert final[1]["files"] == [] and final[1]["text"] == "What is this?"  # the bad file left the box
    final, _ = send(client, "  ")
    assert "The message is empty" in final[2]
    final, _ = send(client, "What is this?", [image])
    assert final[0][-1]["role"] == "assistant"


def fetch(url: str, client: Client | None = None) -> int:
    """The status of a GET of ``url`` with ``client``'s cookies (None: a request without any)."""
    return httpx.get(url, cookies=client.cookies if client else None, timeout=10).status_code


def test_a_session_can_use_and_read_only_its_own_uploads(url, tmp_path, monkeypatch):
    """Client b sends the server path of a's upload without uploading the bytes: refused, also
    after a's second turn with its history (gradio_client uploads the history's files again).
    The file's URL is served to a only; the file is removed when a's session ends."""
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    image = tmp_path / "private.png"  # bytes no other test uploads
    make_image(7, (112, 112)).save(image)
    first, _ = send(a, "Mine.", [str(image)])
    path, = service.open_session(a.session_hash).uploads
    file_url = f"{url}gradio_api/file={path}"
    assert fetch(file_url, a) == 200
    assert fetch(file_url, b) == 404 and fetch(file_url) == 404  # another client, or none, holding the URL
    again, _ = send(a, "Still mine.", history=first[0])  # the history as returned, its picture a download
    assert not again[2].startswith(NOT_ANSWERED) and len(service.open_session(a.session_hash).history) == 2
    # a client that skips the upload and names the server path directly
    monkeypatch.setattr(gradio_client.client.Endpoint, "_upload_file",
                        lambda self, f, data_index: {"path": f["path"], "meta": {"_type": "gradio.FileData"}})
    final, _ = send(b, "Theirs?", [path])
    assert final[2].startswith(NOT_ANSWERED) and "was not uploaded in this session" in final[2]
    assert final[0] == []  # nothing answered
    service.release(a.session_hash)  # a's tab closes
    assert fetch(file_url, a) in (403, 404)  # gone (Gradio answers 403 for a missing file)


def test_two_clients_have_separate_sessions(url, tmp_path):
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    # each its own picture: two uploads of the same bytes at the same instant share one cached path
    # inside Gradio, and once a download of it came back short ("Too little data for declared
    # Content-Length"); that race is Gradio's, not what this test is about
    pictures = {}
    for n, seed in (("a", 4), ("b", 5)):
        pictures[n] = tmp_path / f"{n}.png"
        make_image(seed, (112, 112)).save(pictures[n])
    jobs = [c.submit({"text": f"Hello {n}", "files": [handle_file(str(pictures[n]))]}, [], **controls(), api_name="/chat")
            for n, c in (("a", a), ("b", b))]  # queued on the one GPU slot, both served
    histories = [job.result(timeout=120)[0] for job in jobs]
    assert [h[0]["content"][-1]["text"] for h in histories] == ["Hello a", "Hello b"]
    # b's next turn continues b's chat only: no new-conversation divider, a's messages absent
    final, _ = send(b, "Again", history=histories[1])
    assert "Hello a" not in str(final[0]) and not any((m.get("metadata") or {}).get("title") for m in final[0])


def test_history_is_the_conversation(url, image):
    """``history=[]`` starts afresh every time (the session's cache does not grow); a history that is
    not the session's conversation becomes it (re-read, its picture included), said in the reply."""
    client = Client(url, verbose=False)
    held = []
    for _ in range(3):
        final, _ = send(client, "What is in the picture?", [image])
        session = service.open_session(client.session_hash)
        assert len(final[0]) == 2 and len(session.history) == 1
        held.append(session.conv.cache.nbytes())
    assert held[0] == held[1] == held[2]
    edited = final[0][:-1] + [final[0][-1] | {"content": [{"type": "text", "text": "A different answer."}]}]
    final, _ = send(client, "And the colours?", history=edited)
    marker = final[0][len(edited)]
    assert marker["metadata"]["title"] == REREAD and "not the conversation" in str(marker["content"])
    assert len(service.open_session(client.session_hash).history) == 2  # the picture's turn re-read, then this one
    final, _ = send(client, "And the shapes?", history=final[0])  # the history as returned: continued
    assert len(service.open_session(client.session_hash).history) == 3
    titles = [(m.get("metadata") or {}).get("title") for m in final[0]]
    assert titles.count(REREAD) == 1 and NEW_CONVERSATION not in titles


def test_a_history_sent_from_another_client_is_re_read_with_the_files_it_sends(url):
    """Another client sends a conversation: its returned files are downloads this server holds no
    copy of for it (refused in one line); the same history with each file sent (handle_file) is
    re-read, picture included, and the follow-up about the picture is answered right."""
    scene = str(ROOT / "assets" / "scene_colour.png")
    arena = dict(model="tiny-arena-vl", method="full")
    first, _ = send(Client(url, verbose=False), "What colour is the circle?", [scene], **arena)
    other = Client(url, verbose=False)
    refused, _ = send(other, "What colour is the cross?", history=first[0], **arena)
    assert refused[2].startswith(NOT_ANSWERED) and "holds no copy of" in refused[2] and "\n" not in refused[2]
    sent = [m | {"content": [{"type": "file", "file": handle_file(scene)} if b.get("type") == "file" else b
                             for b in m["content"]]} for m in first[0]]
    final, _ = send(other, "What colour is the cross?", history=sent, **arena)
    assert final[0][-1]["content"][-1]["text"] == "yellow" and "**right**" in final[2], final[2]
    assert [(m.get("metadata") or {}).get("title") for m in final[0]].count(REREAD) == 1


def test_a_method_switched_through_the_api_keeps_the_conversation(url):
    """The history sent back exactly as /chat returned it (a picture in it), with another method:
    the new method re-reads the conversation and answers about the same picture."""
    client = Client(url, verbose=False)
    scene = str(ROOT / "assets" / "scene_colour.png")
    first, _ = send(client, "What colour is the circle?", [scene], model="tiny-arena-vl", method="full")
    assert first[0][-1]["content"][-1]["text"] == "purple"
    final, _ = send(client, "What colour is the cross?", history=first[0], model="tiny-arena-vl", method="h2o",
                    budget=0.9)
    titles = [(m.get("metadata") or {}).get("title") for m in final[0]]
    assert titles.count("Method switched") == 1 and "New conversation" not in titles
    assert final[0][-1]["content"][-1]["text"] == "yellow" and "**right**" in final[2]
    assert len(service.open_session(client.session_hash).history) == 2


def test_the_api_has_its_named_endpoints_and_every_other_event_is_private(url):
    api = Client(url, verbose=False).view_api(print_info=False, return_format="dict")
    assert set(api["named_endpoints"]) == {"/chat", "/compare", "/blind", "/vote", "/leaderboard"}
    assert not api["unnamed_endpoints"]


def test_compare_through_the_api(url, image):
    client = Client(url, verbose=False)
    result = client.predict(message={"text": "Describe.", "files": [handle_file(image)]}, methods=["streamingllm"],
                            **controls(), api_name="/compare")
    table = result[5]
    assert [row[0] for row in table["data"]] == ["Full cache", "StreamingLLM"]


def test_compare_with_a_follow_up_and_its_own_budget_through_the_api(url, image):
    client = Client(url, verbose=False)
    message = {"text": "Describe.", "files": [handle_file(image)]}
    result = client.predict(message=message, methods=["h2o"], follow_up="And the colours?", model=MODEL, budget=0.2,
                            max_new_tokens=3, api_name="/compare")
    assert [row[:2] for row in result[5]["data"]] == [["Full cache", 1], ["Full cache", 2], ["H2O (heavy hitters)", 1],
                                                      ["H2O (heavy hitters)", 2]]
    refused = client.predict(message={"text": "", "files": []}, methods=["h2o"], follow_up="And then?", model=MODEL,
                             api_name="/compare")  # a follow-up without a first question
    status = refused[6]
    assert status.startswith(NOT_ANSWERED) and "The message is empty" in status and "\n" not in status


def test_compare_with_a_picture_and_no_first_question_is_refused_through_the_api(url, image):
    """Refused before any model work, in one line of the status; the picture stays in the box."""
    client = Client(url, verbose=False)
    result = client.predict(message={"text": "  ", "files": [handle_file(image)]}, methods=["h2o"],
                            follow_up="And the colours?", model=MODEL, api_name="/compare")
    status, box, notes = result[service.MAX_COMPARE + 2], result[-2], result[-1]
    assert status.startswith(NOT_ANSWERED) and "The first question is empty" in status and "\n" not in status
    assert len(box["files"]) == 1 and notes == {"__type__": "update"}  # the notes under the table as they were


def test_python_app_py_honours_server_name_and_port_and_starts_without_a_deprecation(tmp_path):
    port = free_port()
    env = os.environ | {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "KV_ARENA_PRELOAD": "0",
                        "KV_ARENA_MODEL": MODEL, "OMP_NUM_THREADS": "1",
                        "PYTHONWARNINGS": "default::DeprecationWarning,default::FutureWarning"}
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.time() + 90
            while time.time() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as page:
                        assert page.status == 200 and b"KV-cache arena" in page.read()
                        break
                except OSError:
                    time.sleep(1)
            else:
                pytest.fail(f"app.py did not answer on port {port}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    said = log.read_text()
    assert "FutureWarning" not in said and "DeprecationWarning" not in said, said


def test_the_readmes_api_snippet_prints_the_answers_as_pasted(url, capsys, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    snippet = next(block for block in readme.split("```python\n")[1:] if "from gradio_client import" in block)
    snippet = snippet.split("```")[0].replace("http://127.0.0.1:7860/", url)
    monkeypatch.chdir(ROOT)
    said = [re.search(r"# (?:the answer: )?(\w+)", line).group(1) for line in snippet.splitlines()
            if line.startswith("print(")]  # each print's comment starts with the answer it prints
    exec(compile(snippet, "README.md", "exec"), {})
    assert said == ["purple", "purple"]  # the bundled model's answers, measured: the comments say them
    assert capsys.readouterr().out.split()[-2:] == said  # after gradio_client's "Loaded as API" line
