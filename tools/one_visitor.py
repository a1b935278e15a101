"""Issue 56's check: one script acting as the proxy cannot pass for many visitors. Starts ``python
app.py`` (the offline model) with ``KV_ARENA_TRUSTED_PROXY_HOPS=1`` on 127.0.0.1 and sends every
request with ``X-Forwarded-For: <forged>, 203.0.113.5`` and a fresh cookie, as a Space's proxy would
pass on a script that forges the first entry; prints what the app let through.

    python -m tools.one_visitor                      # every part
    python -m tools.one_visitor --parts queue        # queue, uploads, blind (comma-separated)

- ``queue``: 40 long events at once (a history of five pairs of 19,000-character messages, re-read
  on a fresh session each), and a victim at another address asking a short question: how many
  queued, and when the victim was answered.
- ``uploads``: 12 uploads of 50 MB no message uses: how many MB the app kept.
- ``blind``: 14 battles, each voted on, in under a minute: how many were recorded, and every progress
  text sent before a vote that names a method.
- ``sessions``: 60 chats, each on a fresh session (``/call/chat``, raw HTTP: no heartbeat), 4 at
  once: what they added to the app's memory (its resident set) and how many sessions it still holds.

Lives outside ``kv_arena/``: it drives the app. Exit code 2 and one line for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tools.app_process import AppProcess
from tools.long_video import resident
from tools.upload_flood import kept_bytes, payload

PROXY_SAW = "203.0.113.5"  # the address the (trusted) proxy appends: the script's real one
VICTIM = "198.51.100.77"
PARTS = ("queue", "uploads", "blind", "sessions")


def forged(i: int) -> dict:
    """A request's headers as the proxy passes them on: a forged first entry, a fresh cookie."""
    return {"x-forwarded-for": f"192.0.2.{i % 250}, {PROXY_SAW}", "cookie": f"kv_arena_client={uuid.uuid4().hex}"}


def chat_values(url: str, message: dict, history: list) -> list:
    """The ``/chat`` endpoint's values: the message, the history, every setting at its default."""
    info = httpx.get(f"{url}gradio_api/info", timeout=30).json()["named_endpoints"]["/chat"]["parameters"]
    return [message, history] + [p.get("parameter_default") for p in info[2:]]


def events_until_done(url: str, event: httpx.Response, headers: dict, timeout: float = 600) -> str:
    """An event's messages (``/call/chat/<id>``) read to the end: its last data line."""
    event_id = event.json()["event_id"]
    with httpx.stream("GET", f"{url}gradio_api/call/chat/{event_id}", headers=headers, timeout=timeout) as stream:
        return [line for line in stream.iter_lines() if line.startswith("data:")][-1]


def queue_part(url: str) -> None:
    pair = ("purple " * 2715)[:19_000]  # 19,000 characters: about 2,700 tokens of the offline model
    said = [{"type": "text", "text": pair}]  # a message's content as Gradio's chat sends it
    history = [m for _ in range(5) for m in ({"role": "user", "content": said}, {"role": "assistant", "content": said})]
    values = chat_values(url, {"text": "What colour is the circle?", "files": []}, history)

    def join(i: int) -> httpx.Response:
        return httpx.post(f"{url}gradio_api/call/chat", json={"data": values}, headers=forged(i), timeout=60)

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(join, range(40)))
    victim_headers = {"x-forwarded-for": f"192.0.2.1, {VICTIM}"}
    mine = httpx.post(f"{url}gradio_api/call/chat", headers=victim_headers, timeout=60,
                      json={"data": chat_values(url, {"text": "Hi", "files": []}, [])})
    last = events_until_done(url, mine, victim_headers)
    waited = time.monotonic() - start
    codes = [a.status_code for a in answers]
    print(f"queue: 40 long events from one visitor: {codes.count(200)} queued, {codes.count(429)} refused (429), "
          f"{len(codes) - codes.count(200) - codes.count(429)} other; the victim ({VICTIM}) "
          f"{'was answered' if mine.status_code == 200 and 'error' not in last[:12] else 'got ' + last[:80]} "
          f"{waited:.1f} s after the flood began")
    refused = next((a for a in answers if a.status_code == 429), None)
    if refused is not None:
        print(f"  refusal: {refused.json()['detail']}")
    for answer in (a for a in answers if a.status_code == 200):
        print(f"  a queued event's status line: {status_line(events_until_done(url, answer, forged(0)))}")


def status_line(last: str) -> str:
    """The chat's status line in an event's last message (its first output that reads as one)."""
    try:
        outputs = json.loads(last[len("data:"):])
    except ValueError:
        return last[:160]
    lines = [o for o in outputs if isinstance(o, str)] if isinstance(outputs, list) else []
    return (lines[0] if lines else str(outputs))[:200].replace("\n", " ")


def uploads_part(url: str, tmp: Path) -> None:
    answers = []
    for i in range(12):
        files = [("files", (f"flood-{i}.bin", payload(i, 50 * 2**20)))]
        answers.append(httpx.post(f"{url}gradio_api/upload", files=files, headers=forged(i), timeout=120))
    taken = sum(a.status_code == 200 for a in answers)
    print(f"uploads: 12 x 50 MB from one visitor: {taken} taken, {sum(a.status_code == 413 for a in answers)} refused "
          f"(413); kept on disk: {kept_bytes(tmp) / 2**20:.0f} MB")


def blind_part(url: str) -> None:
    from gradio_client import Client, handle_file
    from gradio_client import utils as client_utils

    from kv_arena import backends, service

    sent: list[str] = []  # every progress line the server sends before a vote
    read = client_utils.ProgressUnit.from_msg
    client_utils.ProgressUnit.from_msg = staticmethod(lambda data: (sent.extend(str(u.get("desc")) for u in data),
                                                                    read(data))[1])
    scene = service.scene_examples()[0]
    start, recorded = time.monotonic(), 0
    for i in range(14):
        c = Client(url, verbose=False, headers={"x-forwarded-for": forged(i)["x-forwarded-for"]})  # a fresh cookie
        shown = c.predict(message={"text": scene.questions[0], "files": [handle_file(f) for f in scene.files]},
                          model="tiny-arena-vl", method="random", budget="random", battle="", api_name="/blind")
        if isinstance(shown[0], str) and shown[0]:
            sent.extend(str(x) for x in shown[3:5])  # the status and timing lines shown with the answers
            recorded += "Vote recorded" in str(c.predict(battle=shown[0], choice="A", api_name="/vote")[1])
    titles = {backends.backend_class(n).title for n in backends.available() if not backends.is_reference(n)}
    naming = sorted({t for t in titles for line in sent if t in line})
    print(f"blind: 14 battles, each voted on, from one visitor with a fresh cookie each: {recorded} recorded "
          f"in {time.monotonic() - start:.0f} s; progress and status lines before the votes: {len(sent)}, "
          f"naming a method: {len(naming)}{' (' + ', '.join(naming) + ')' if naming else ''}")


def resident_mb(pid: int) -> float:
    """The process's resident memory (Linux: ``/proc/<pid>/status``), in MB."""
    return resident(pid, "VmRSS") / 2**20


def sessions_part(url: str, pid: int, count: int = 60) -> None:
    from kv_arena import service

    scene = service.scene_examples()[0]  # a picture: its visual tokens are most of what a session holds

    def chat(i: int) -> bool:
        headers = forged(i)  # one cookie for the upload and the chat naming it
        files = []
        for path in scene.files:
            with open(path, "rb") as f:
                sent = httpx.post(f"{url}gradio_api/upload", files=[("files", (Path(path).name, f.read()))],
                                  headers=headers, timeout=60)
            files += [{"path": p, "meta": {"_type": "gradio.FileData"}} for p in sent.json()] if sent.status_code == 200 else []
        values = chat_values(url, {"text": scene.questions[0], "files": files}, [])
        answer = httpx.post(f"{url}gradio_api/call/chat", json={"data": values}, headers=headers, timeout=60)
        return answer.status_code == 200 and "error" not in events_until_done(url, answer, headers)[:12]

    chat(0)  # the model loaded and its first answer given: the memory a visitor's sessions add is what follows
    before, start = resident_mb(pid), time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answered = sum(pool.map(chat, range(1, count + 1)))
    after = resident_mb(pid)
    print(f"sessions: {count} chats with a picture, each on a fresh session, from one visitor, 4 at once: "
          f"{answered} answered in {time.monotonic() - start:.0f} s; the app's memory {before:.0f} MB before, "
          f"{after:.0f} MB after (+{after - before:.0f} MB)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or any(x not in PARTS for x in parts):
        print(f"error: --parts takes {', '.join(PARTS)} (comma-separated)", file=sys.stderr)
        return 2
    env = {"KV_ARENA_TRUSTED_PROXY_HOPS": "1", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}  # as `python app.py` runs
    with tempfile.TemporaryDirectory(prefix="kv-arena-visitor-") as tmp:
        with AppProcess(Path(tmp), env, model="tiny-arena-vl") as app:
            if "uploads" in parts:
                uploads_part(app.url, Path(tmp))
            if "blind" in parts:
                blind_part(app.url)
            if "queue" in parts:
                queue_part(app.url)
            if "sessions" in parts:
                sessions_part(app.url, app.process.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
