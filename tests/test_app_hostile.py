"""A public Space against hostile visitors (issue 36), each case through the launched app as an
attacker sends it (``gradio_client``, or raw HTTP for what a client library never does), on
127.0.0.1 only and in bounded loops: another client's upload and overlay behind every spelling
of the file routes, a video whose frames would take gigabytes, a hub architecture built at full
size, "New scene" called a hundred times, sessions that never heartbeat, NaN and infinities in
every knob, a failure inside the model in the middle of a conversation, and a client that goes
away during a streamed prefill. One server for the module; the idle-session test comes last (it
sets a short idle time, which ends every idle session of the module)."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from PIL import Image
from gradio_client import Client, handle_file

from components import chat, settings
from components.compare import SLOTS
from components.chat import NEW_CONVERSATION, NOT_ANSWERED, transcript
from kv_arena import service
from kv_arena.errors import UserError
from kv_arena.runtime.generate import Conversation
from kv_arena.service import sessions, uploads
from kv_arena.service.store import media_store
from tests.app_support import MODEL, ask, config, launched_app
from tests.support import make_image, write_mjpeg_avi
from tests.test_app_client import controls, send


@pytest.fixture(scope="module")
def server():
    """(demo, url) of one launched app."""
    with launched_app() as launched:
        yield launched


@pytest.fixture(scope="module")
def url(server):
    return server[1]


def fn_index(demo, name: str) -> int:
    """The index of the event whose function (or API name) is ``name``, as a browser names it."""
    return next(i for i, fn in demo.fns.items() if name in (fn.name, fn.api_name))


def one_line(status: str, expected: str) -> None:
    assert status.startswith(NOT_ANSWERED) and expected in status, status
    assert "\n" not in status and "Traceback" not in status


# --- raw HTTP, as a script that keeps no cookies and opens no heartbeat sends it -----------------
def raw_upload(http: httpx.Client, url: str, path: str) -> str:
    with open(path, "rb") as f:
        answer = http.post(f"{url}gradio_api/upload", files=[("files", (Path(path).name, f.read()))], timeout=30)
    answer.raise_for_status()
    (server_path,) = answer.json()
    return server_path


def raw_event(url: str, index: int, data: list, session_hash: str, timeout: float = 120,
              http: httpx.Client | None = None) -> dict:
    """Queue one event and read its messages until it completes; returns the last message.
    ``http``: a client that keeps the app's cookie (None: a fresh one, which keeps none between calls)."""
    if http is None:
        with httpx.Client() as fresh:
            return raw_event(url, index, data, session_hash, timeout, fresh)
    body = {"data": data, "fn_index": index, "session_hash": session_hash, "event_data": None, "trigger_id": None}
    joined = http.post(f"{url}gradio_api/queue/join", timeout=30, headers={"content-type": "application/json"},
                       content=json.dumps(body))  # NaN and Infinity as JSON's extension writes them
    joined.raise_for_status()
    deadline = time.monotonic() + timeout
    with http.stream("GET", f"{url}gradio_api/queue/data", params={"session_hash": session_hash},
                     timeout=timeout) as stream:
        for line in stream.iter_lines():
            if time.monotonic() > deadline:
                break
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed":
                    return message
    raise AssertionError("the event did not complete")


def file_data(path: str) -> dict:
    return {"path": path, "orig_name": Path(path).name, "meta": {"_type": "gradio.FileData"}}


def chat_data(message: dict, **kw) -> list:
    """The chat event's inputs in the order the browser sends them: message, history, session, controls."""
    return [message, [], None, *settings.control_values(model=MODEL, method=kw.pop("method", "streamingllm"),
                                                        max_new_tokens=kw.pop("max_new_tokens", 4), **kw)]


# --- 1. every file route checks the client ------------------------------------------------------
def spellings(path: str) -> list[str]:
    """A server path as every file route and encoding can name it."""
    parent, name = path.rsplit("/", 1)
    return [f"gradio_api/file={path}", f"gradio_api/file/{path}", f"gradio_api/file={quote(path, safe='')}",
            f"gradio_api/file={quote(quote(path, safe=''), safe='')}", f"gradio_api/file/{quote(path, safe='/')}",
            f"gradio_api/file={parent}/./{name}", f"gradio_api/file={parent}//{name}",
            f"gradio_api/file={parent}/../{Path(parent).name}/{name}", f"gradio_api/file?path={quote(path)}",
            f"file={path}", f"file/{path}"]


def status_of(url: str, client: Client | None) -> int:
    return httpx.get(url, cookies=client.cookies if client else None, timeout=10).status_code


def test_every_file_route_serves_an_upload_and_its_overlay_to_its_client_only(url, tmp_path):
    owner, other = Client(url, verbose=False), Client(url, verbose=False)
    picture = tmp_path / "mine.png"
    make_image(21, (112, 112)).save(picture)
    final, _ = send(owner, "Mine.", [str(picture)])
    assert not final[2].startswith(NOT_ANSWERED)
    session = service.open_session(owner.session_hash)
    (upload,) = session.uploads
    overlays = sorted(uploads.session_folder(session.id, "overlays").glob("*.png"))
    assert overlays and final[7]  # the gallery names the session's own overlay files
    for path in (upload, str(overlays[-1])):
        for route in (f"gradio_api/file={path}", f"gradio_api/file/{path}"):
            assert status_of(url + route, owner) == 200, route
        for route in spellings(path):
            assert status_of(url + route, other) == 404, route
            assert status_of(url + route, None) == 404, route
    sessions.release(owner.session_hash)  # the tab closes: its overlays go with it
    assert not any(Path(p).exists() for p in overlays) and not Path(upload).exists()


# --- 2. one budget of decoded pixels ------------------------------------------------------------
def peak_rss_kb() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


def test_a_16_frame_4000_px_video_is_refused_before_decoding(url, tmp_path):
    video = tmp_path / "huge.avi"
    frame = Image.new("RGB", (4000, 4000), (200, 30, 30))
    write_mjpeg_avi(video, [frame] * 16, 1)  # a few hundred KB that decode to 768 MB
    del frame
    client = Client(url, verbose=False)
    try:
        reset_peak_rss()
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    idle = peak_rss_kb()
    job = client.submit(message={"text": "What happens?", "files": [handle_file(str(video))]}, history=[],
                        **(controls() | {"num_frames": 16}), api_name="/chat")
    final = job.result(timeout=120)
    one_line(final[2], "16 frames of 4000 x 4000")
    assert "the limit is 100 million pixels per message" in final[2]
    assert peak_rss_kb() - idle < 200 * 1024  # within 200 MB of idle (decoding would take 768 MB)


def test_the_budget_is_one_for_images_and_frames_together(tmp_path):
    """Four 4800 x 4800 images (92 M pixels) pass, so does a video of 8 frames at 1000 x 1000 (8 M):
    together they are refused. Sizes come from the headers (AVI, MP4), nothing is decoded."""
    from kv_arena.media import check_decoded_pixels, decoded_pixels, video_size

    images = []
    for i in range(4):
        images.append(str(tmp_path / f"big{i}.png"))
        Image.new("RGB", (4800, 4800)).save(images[-1])
    video = tmp_path / "square.avi"
    write_mjpeg_avi(video, [Image.new("RGB", (1000, 1000), "navy")] * 8, 1)
    assert video_size(str(video)) == (1000, 1000)
    assert video_size(str(Path(service.__file__).parents[2] / "assets" / "bouncing_ball.mp4")) == (224, 224)
    pictures = [decoded_pixels(p, False) for p in images]
    frames = decoded_pixels(str(video), True, num_frames=8)
    assert frames == (8_000_000, "square.avi: 8 frames of 1000 x 1000")
    check_decoded_pixels(pictures)
    check_decoded_pixels([frames])
    with pytest.raises(UserError, match=r"would decode 100.2 million pixels \(big0.png; .* square.avi: 8 frames"):
        check_decoded_pixels(pictures + [frames])


def test_a_video_that_decodes_larger_than_its_header_says_is_held_to_the_budget(tmp_path):
    """Headers that say 64 x 64 over frames of 3000 x 3000: the first frame decoded tells, the
    other fifteen are never decoded."""
    import struct

    from kv_arena.media import decoded_pixels, load_video

    video = tmp_path / "liar.avi"
    write_mjpeg_avi(video, [Image.new("RGB", (3000, 3000), "teal")] * 16, 1)
    data = bytearray(video.read_bytes())
    for tag, offset in ((b"avih", 8 + 32), (b"strf", 8 + 4)):  # the main header's size, the stream format's
        struct.pack_into("<II", data, data.find(tag) + offset, 64, 64)
    video.write_bytes(bytes(data))
    assert decoded_pixels(str(video), True, 16)[0] == 16 * 64 * 64
    with pytest.raises(UserError, match=r"liar.avi: 16 frames of 3000 x 3000\); the limit is 100 million"):
        load_video(str(video), 16)


# --- 3. random: architectures --------------------------------------------------------------------
def test_random_architectures_are_refused_by_default(url, monkeypatch):
    monkeypatch.delenv("KV_ARENA_RANDOM_MODELS", raising=False)
    assert not any(name.startswith("random:") for _, name in service.model_choices())
    client = Client(url, verbose=False)
    final = client.predict(message={"text": "Hi", "files": []}, history=[],
                           **(controls() | {"model": "random:Qwen/Qwen3-VL-30B-A3B-Instruct"}), api_name="/chat")
    one_line(final[2], "is not offered on this server")
    monkeypatch.setenv("KV_ARENA_RANDOM_MODELS", "1")  # an operator allows them: under the cap only
    with pytest.raises(UserError, match="31.1 billion parameters"):
        service.check_model_allowed("random:Qwen/Qwen3-VL-30B-A3B-Instruct")


# --- 4. "New scene" is bounded on disk and reachable through the queue only ----------------------
def test_a_hundred_new_scenes_leave_at_most_the_cap_on_disk(server, monkeypatch):
    demo, url = server
    monkeypatch.setenv("KV_ARENA_MAX_SCENES", "8")
    index = fn_index(demo, "new_scene")
    hashes = [uuid.uuid4().hex[:11] for _ in range(10)]  # ten "tabs", ten calls each
    for i in range(100):
        message = raw_event(url, index, ["colour", None], hashes[i % 10])
        assert message["success"], message
    scenes = uploads.private_root() / "scenes"
    drawn = [item for session in scenes.iterdir() for item in session.iterdir()]
    assert 1 <= len(drawn) <= 8
    direct = httpx.post(f"{url}gradio_api/run/predict", json={"data": ["colour", None], "fn_index": index}, timeout=10)
    assert direct.status_code == 404  # not around the queue


def method_of(knob: str) -> str:
    """The method a knob belongs to (picked, so its parameters are the ones that count), else one with a budget."""
    return next((spec["name"] for spec in service.method_specs() if knob.startswith(spec["name"] + "_")),
                "streamingllm")


# --- 6. NaN and infinities, every knob; a failure inside the model -------------------------------
NUMERIC = [name for name, value in zip(settings.control_names(), settings.control_values(model=MODEL))
           if isinstance(value, (int, float)) and not isinstance(value, bool)]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "Infinity", "NaN"])
@pytest.mark.parametrize("knob", NUMERIC)
def test_nan_and_infinities_are_refused_in_one_line_for_every_knob(knob, value, media):
    method = method_of(knob)
    named = dict(zip(settings.control_names(), settings.control_values(model=MODEL, method=method)))
    outputs = list(chat.submit(ask("Hi", media["image"]), [], service.Session(), None, None, **(named | {knob: value})))
    (refused,) = outputs
    one_line(refused.status, "")
    assert "finite" in refused.status or "must be a number" in refused.status, refused.status


@pytest.mark.parametrize("knob", ["budget", "max_new_tokens", "h2o_recent_share", "streamingllm_sink_tokens",
                                  "zipvl_tau", "mpic_recompute_ratio"])
def test_nan_and_infinity_through_the_api(server, knob):
    """Sent raw: gradio_client (httpx) refuses to write NaN into JSON, a script need not."""
    demo, url = server
    names = settings.control_names()
    for value in (math.nan, math.inf, -math.inf):
        data = chat_data({"text": "Hi", "files": []}, method=method_of(knob))
        data[3 + names.index(knob)] = value
        message = raw_event(url, fn_index(demo, "chat"), data, uuid.uuid4().hex[:11])
        one_line(message["output"]["data"][2], "")


def test_a_failure_inside_the_model_keeps_the_previous_turns(url, tmp_path):
    scene = service.scene_examples()[0]
    client = Client(url, verbose=False)
    ask_arena = controls() | {"model": service.ARENA, "method": "full", "max_new_tokens": 8}

    def say(text, files=(), history=()):
        return client.submit(message={"text": text, "files": [handle_file(f) for f in files]},
                             history=list(history), **ask_arena, api_name="/chat").result(timeout=180)

    first = say(scene.questions[0], scene.files)
    assert "**right**" in first[2], first[2]
    thin = tmp_path / "thin.png"
    Image.new("RGB", (20000, 10), "white").save(thin)  # an aspect ratio no Qwen-VL processor takes
    failed = say("And this?", [str(thin)], first[0])
    one_line(failed[2], "The conversation is as it was before this message")
    assert transcript(failed[0]) == transcript(first[0])
    then = say(scene.questions[1], history=first[0])  # the follow-up about the first picture
    assert "**right**" in then[2], then[2]
    assert not any((m.get("metadata") or {}).get("title") == NEW_CONVERSATION for m in then[0])


# --- 7. a client gone mid-prefill stops it --------------------------------------------------------
def test_a_streamed_prefill_stops_between_chunks_when_its_client_goes(tmp_path, monkeypatch):
    from kv_arena.media import write_avi
    from tests.support import make_video

    fed = []
    real = Conversation.prefill_chunk

    def counted(self, chunk, cap_bytes=None):
        fed.append(chunk)
        time.sleep(0.05)  # a chunk takes longer than the status line's throttle: the client sees the stream
        return real(self, chunk, cap_bytes)

    monkeypatch.setattr(Conversation, "prefill_chunk", counted)
    video = tmp_path / "long.avi"  # 48 frames: 12 chunks (the bundled clip has fewer frames than asked for)
    write_avi(video, make_video(2, frames=48, size=112).frames, fps=8)
    session = service.Session()
    answer = chat.respond(ask("Where does the ball go?", str(video)), [], session,
                          config("streamingllm", num_frames=48, stream_cap_mb=1))
    for outputs in answer:
        if isinstance(outputs.status, str) and "Streaming frame" in outputs.status:
            break  # the first chunk is in: the client goes
    answer.close()  # what Gradio does to an event whose client went away, at its next yield
    chunks = len(fed)
    assert 0 < chunks < 48 // 4  # stopped between the chunks, long before the video's end
    time.sleep(0.3)
    assert len(fed) == chunks and session.history == []


# --- 8. malformed input and the routes an operator keeps closed ----------------------------------
def test_malformed_history_and_method_lists_are_one_line(url, capfd):
    client = Client(url, verbose=False)
    for history in ("not a list", [1, 2], [{"role": "user", "content": 5}], [{"role": "robot", "content": []}]):
        final = client.predict(message={"text": "Hi", "files": []}, history=history, **controls(), api_name="/chat")
        one_line(final[2], "The chat history is not a list of messages")
    for methods in ("snapkv", [["snapkv"]], {"snapkv": 1}):
        result = client.predict(message={"text": "Hi", "files": []}, methods=methods, **controls(), api_name="/compare")
        status = result[SLOTS + 1]
        assert "must be a list of method names" in status and "\n" not in status, status
    assert "Traceback" not in capfd.readouterr().err


def test_a_lone_surrogate_in_the_text_is_one_line(server, capfd):
    """Sent raw: JSON may escape one (\\ud800), httpx cannot encode it from Python text."""
    demo, url = server
    for message in ({"text": "What is \ud800 this?", "files": []}, "Only \udfff text"):
        answer = raw_event(url, fn_index(demo, "chat"), chat_data(message), uuid.uuid4().hex[:11])
        one_line(answer["output"]["data"][2], "is not valid text")
    assert "Traceback" not in capfd.readouterr().err


def test_unknown_event_ids_and_monitoring_are_refused_quietly(url, capfd):
    for path in ("gradio_api/call/chat/not-an-id", "gradio_api/call/chat/0123456789abcdef0123456789abcdef",
                 "gradio_api/queue/data?session_hash=nobody"):
        assert httpx.get(url + path, timeout=10).status_code == 404
    for path in ("monitoring", "monitoring/summary", "gradio_api/monitoring/summary"):
        assert httpx.get(url + path, timeout=10).status_code in (403, 404)
    assert "Traceback" not in capfd.readouterr().err


def test_a_path_outside_the_upload_folder_is_one_line(server, tmp_path):
    demo, url = server
    outside = tmp_path / "server-side.png"
    make_image(5, (64, 64)).save(outside)
    for sent in ({"path": str(outside), "orig_name": "x.png"}, file_data(str(outside)), file_data("/etc/hostname"),
                 file_data(f"{uploads.upload_dir()}/../../{outside}")):  # without Gradio's marker, with it, climbing out
        message = raw_event(url, fn_index(demo, "chat"), chat_data({"text": "Whose?", "files": [sent]}),
                            uuid.uuid4().hex[:11])
        one_line(message["output"]["data"][2], "was not uploaded to this app")


# --- 5. sessions that never heartbeat (last: a short idle time ends every idle session) ----------
@pytest.mark.parametrize("keeps_cookies", [True, False], ids=["a script that keeps cookies", "one that keeps none"])
def test_a_raw_http_session_is_gone_after_the_idle_time(server, monkeypatch, tmp_path, keeps_cookies):
    demo, url = server
    monkeypatch.setenv("KV_ARENA_SESSION_IDLE_S", "2")
    picture = tmp_path / "raw.png"
    make_image(31 + keeps_cookies, (112, 112)).save(picture)
    session_hash = uuid.uuid4().hex[:11]
    with httpx.Client() as http:  # no heartbeat, ever
        upload = raw_upload(http, url, str(picture))
        message = raw_event(url, fn_index(demo, "chat"),
                            chat_data({"text": "What is it?", "files": [file_data(upload)]}, method="mpic"),
                            session_hash, http=http if keeps_cookies else None)
    assert message["success"] and not message["output"]["data"][2].startswith(NOT_ANSWERED), message
    session = service.open_session(session_hash)
    store = media_store().root / media_store().namespace(session.id)
    overlays = uploads.session_folder(session.id, "overlays")
    assert Path(upload).exists() and store.is_dir() and any(overlays.iterdir())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (Path(upload).exists() or store.exists() or overlays.exists()):
        time.sleep(0.25)
    assert not Path(upload).exists() and not store.exists() and not overlays.exists()
    assert service.open_session(session_hash) is None


def test_an_upload_no_session_takes_is_gone_after_the_idle_time(url, monkeypatch, tmp_path):
    monkeypatch.setenv("KV_ARENA_SESSION_IDLE_S", "2")
    picture = tmp_path / "left.png"
    make_image(33, (112, 112)).save(picture)
    with httpx.Client() as http:
        upload = raw_upload(http, url, str(picture))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(upload).exists():
        time.sleep(0.25)
    assert not Path(upload).exists()


def test_at_start_the_folders_of_gone_processes_are_swept_and_a_live_replicas_kept(tmp_path, monkeypatch):
    """Two app processes on one host share the temp folders: each writes under its own instance
    folder and holds its lock while it lives; the one starting sweeps only the folders of processes
    that are gone (a kill leaves its lock free), for the media store and the private files alike."""
    import fcntl

    from kv_arena.service import instance, store

    def other_process(parent, name):
        folder = parent / name / ("ab" * 16)
        folder.mkdir(parents=True)
        (folder / "x.safetensors").write_bytes(b"\0")
        (parent / name / instance.ALIVE).touch()
        return parent / name

    for parent, sweep in ((tmp_path / "kv", lambda: store.store_at_start()),
                          (uploads.upload_dir() / uploads.PRIVATE_ROOT, uploads.sweep_private_folders)):
        parent.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("KV_ARENA_KV_STORE", str(tmp_path / "kv"))
        dead = other_process(parent, f"p1-{uuid.uuid4().hex[:8]}")
        live = other_process(parent, f"p2-{uuid.uuid4().hex[:8]}")
        keep = parent / f"operator-notes-{uuid.uuid4().hex[:6]}"
        keep.mkdir()
        with open(live / instance.ALIVE) as held:  # a live replica holds its lock
            fcntl.flock(held, fcntl.LOCK_EX)
            sweep()
            assert not dead.exists() and live.exists() and keep.exists()
        assert instance.abandoned(live)  # its process gone, the next start sweeps it
        assert not instance.abandoned(instance.own_folder(parent))  # never this process's own
        shutil.rmtree(live)
        keep.rmdir()


def test_a_client_that_cancels_mid_prefill_stops_it(url, tmp_path, monkeypatch):
    """Through the queue: the client's cancel reaches the streamed prefill at its next chunk (a
    prefill that never hands control back would run all 30 chunks, 6 s, whatever the client did)."""
    from kv_arena.service.streamed import FRAMES_PER_CHUNK

    fed = []
    real = Conversation.prefill_chunk

    def counted(self, chunk, cap_bytes=None):
        fed.append(time.monotonic())
        time.sleep(0.2)  # a slow chunk, as a real model's is
        return real(self, chunk, cap_bytes)

    monkeypatch.setattr(Conversation, "prefill_chunk", counted)
    frames = 30 * FRAMES_PER_CHUNK
    video = tmp_path / "long.avi"
    write_mjpeg_avi(video, [Image.new("RGB", (32, 32), (i % 250, 90, 0)) for i in range(frames)], 1)
    client = Client(url, verbose=False)
    job = client.submit(message={"text": "What happens?", "files": [handle_file(str(video))]}, history=[],
                        **(controls() | {"num_frames": frames, "stream_cap_mb": 1}), api_name="/chat")
    deadline = time.monotonic() + 60
    while len(fed) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(fed) >= 3, "the streamed prefill never started"
    job.cancel()
    time.sleep(1.0)  # the chunk under way ends, and the next yield stops it
    stopped = len(fed)
    time.sleep(2.0)
    assert len(fed) == stopped and stopped <= 12  # nothing since, far from the video's 30 chunks
