"""What one hostile visitor costs the app server: start ``python app.py`` (the offline model) as a
process of its own, send an attack through ``/chat`` with gradio_client on 127.0.0.1, and print the
server's CPU seconds (``/proc/PID/stat``), resident memory before and after, and its peak during the
attack (``VmHWM``, reset through ``/proc/PID/clear_refs``), with what the client was told.

    python -m tools.hostile_cost message --mb 60        # one message of 60 MB of text
    python -m tools.hostile_cost switch --frames 300 --turns 3 --flips 4 --cap-mb 2

``message``: one /chat message whose text is ``--mb`` megabytes. ``switch``: ``--turns`` turns,
each streaming a ``--frames``-frame video under ``--cap-mb`` with StreamingLLM, then ``--flips``
follow-ups of four words that flip the method between SnapKV and StreamingLLM, each one a switch
that re-reads the conversation; per flip the CPU seconds and the chat's switch line. Linux only
(``/proc``). Lives outside ``kv_arena/``: it drives the UI. Exit code 2 and one line for bad input.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.app_cost import free_port

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


class Server:
    """``python app.py`` in its own process, on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        port = free_port()
        env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
                   KV_ARENA_MODEL="tiny-arena-vl")
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}/"
        import httpx

        for _ in range(240):
            try:
                if httpx.get(self.url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise SystemExit("error: the app did not start in 2 minutes")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory(self, key: str) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def reset_peak(self) -> None:
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def measured(server: Server, attack) -> tuple[str, dict]:
    server.reset_peak()
    before_cpu, before_rss, start = server.cpu_s(), server.memory("VmRSS"), time.perf_counter()
    try:
        told = attack()
    except Exception as exc:  # what the client is told: a refusal is the expected answer
        told = f"{exc.__class__.__name__}: {' '.join(str(exc).split())[:200]}"
    return told, {"cpu_s": server.cpu_s() - before_cpu, "wall_s": time.perf_counter() - start,
                  "rss_before_gb": before_rss / 2**30, "peak_gb": server.memory("VmHWM") / 2**30,
                  "rss_after_gb": server.memory("VmRSS") / 2**30}


def row(name: str, figures: dict, told: str) -> str:
    return (f"{name}: server CPU {figures['cpu_s']:.1f} s, wall {figures['wall_s']:.1f} s, memory "
            f"{figures['rss_before_gb']:.2f} GB before, peak {figures['peak_gb']:.2f} GB, {figures['rss_after_gb']:.2f} "
            f"GB after; told: {told[:160]}")


def message_attack(server: Server, megabytes: float) -> None:
    from gradio_client import Client

    client = Client(server.url, verbose=False, download_files=False)
    text = "What colour is the ring? " * int(megabytes * MB / 25)

    def attack():
        result = client.predict(message={"text": text, "files": []}, history=[], api_name="/chat")
        return str(result[2])

    told, figures = measured(server, attack)
    print(row(f"one message of {len(text) / MB:.0f} MB", figures, told))


def write_video(path: Path, frames: int) -> None:
    from kv_arena.media import write_avi

    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (1, 112, 112, 3), dtype=np.uint8)
    write_avi(path, np.repeat(base, frames, axis=0), fps=4)


def switch_attack(server: Server, frames: int, turns: int, flips: int, cap_mb: float) -> None:
    from gradio_client import Client, handle_file

    client = Client(server.url, verbose=False, download_files=False)
    video = Path(tempfile.mkdtemp()) / "long.avi"
    write_video(video, frames)
    history, method = [], "streamingllm"
    for k in range(turns):
        result = client.predict(message={"text": "What happens?", "files": [handle_file(str(video))]}, history=history,
                                method=method, num_frames=frames, stream_cap_mb=cap_mb, max_new_tokens=4,
                                api_name="/chat")
        history = result[0]
        print(f"turn {k + 1}: {str(result[2])[:120]}", flush=True)
    for k in range(flips):
        method = "snapkv" if method == "streamingllm" else "streamingllm"
        answered = {}

        def attack():
            result = client.predict(message={"text": "And what now, then?", "files": []}, history=history,
                                    method=method, num_frames=frames, stream_cap_mb=cap_mb, max_new_tokens=4,
                                    api_name="/chat")
            answered["history"] = result[0]
            said = [str(m.get("content")) for m in result[0][len(history):] if "re-read" in str(m.get("content"))]
            return said[-1] if said else str(result[2])

        told, figures = measured(server, attack)
        print(row(f"flip {k + 1} to {method}", figures, told), flush=True)
        if len(answered.get("history", [])) > len(history):  # answered: the chat goes on from there
            history = answered["history"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="attack", required=True)
    m = sub.add_parser("message")
    m.add_argument("--mb", type=float, default=60)
    s = sub.add_parser("switch")
    s.add_argument("--frames", type=int, default=300)
    s.add_argument("--turns", type=int, default=3)
    s.add_argument("--flips", type=int, default=4)
    s.add_argument("--cap-mb", type=float, default=2)
    args = p.parse_args(argv)
    if not Path("/proc/self/stat").exists():
        print("error: this tool reads /proc (Linux)", file=sys.stderr)
        return 2
    server = Server()
    try:
        if args.attack == "message":
            message_attack(server, args.mb)
        else:
            switch_attack(server, args.frames, args.turns, args.flips, args.cap_mb)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
