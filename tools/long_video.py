"""A 10-minute video streamed through the app at a fixed KV cap, as a user sends it: draw the video,
start ``python app.py`` (the offline model), send the video and its question to ``/chat`` with
gradio_client under ``stream_cap_mb``, and print, per method, what the app says (frames streamed,
chunks, the cap, the most KV held while a chunk went in, the KV held after the answer, the first
token's time), the server's resident memory before the call and at most during it, the call's wall time,
and the answer against the true one. Each method runs in an app of its own, started for it.

    python -m tools.long_video                                  # 10 min at 1 fps, full and InfiniPot-V, 1 MB
    python -m tools.long_video --methods full,infinipot_v,streamingllm,snapkv --videos 8 --cap-mb 1

The video is the bundled model's (v3.1's) held-out long video (kv_arena/tiny/long_videos.py):
``long_moving``, "Which shape moves?" with motion all through, or ``--question glimpse``, "What
colour is the star?" about an object in view for a short stretch; 40-72 frames spread over
``--minutes``, written at ``--fps`` as an uncompressed AVI (``kv_arena.media.write_avi``). The app
is asked for the drawn frames, which it samples evenly from the whole video: exactly the drawn ones,
each a different moment; it streams them 8 a chunk, and each method answers in a new session. The
full cache streams without a cap (the reference: its KV grows with the video).

``--question moving`` sends v3's held-out "moving" scene instead, each of its frames held for an
equal share of ``--minutes``; the app samples ``--fps`` x 60 x ``--minutes`` frames from it (every
frame written), 600 over 10 minutes.

Memory is the app server's own (a separate process, ``/proc/PID/status``): its resident set before
the call and its peak during it (``VmHWM``, reset before each call through ``/proc/PID/clear_refs``
on Linux). For scale, the tool also decodes the clip whole in its own process, as the app did before
it decoded a long video a chunk at a time, and prints what that took. Exit code 2 and one line for
bad input. Lives outside ``kv_arena/``: it drives the UI.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kv_arena.tiny.long_videos import LONG_TYPES, held_out_long
from tools.app_cost import free_port

ROOT = Path(__file__).resolve().parents[1]

MB = 2**20
STATUS = {  # what the chat's status line says, as it says it
    "stream": re.compile(r"streamed (\d+) frames in (\d+) chunks (?:under a cap of ([\d.]+ \w+) \(at most ([\d.]+ \w+)"
                         r"|without a cap \(up to ([\d.]+ \w+))"),
    "kv": re.compile(r"KV cache ([\d.]+ \w+)"),
    "first_token": re.compile(r"first token after ([\d.]+) s"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the video's length")
    p.add_argument("--fps", type=int, default=1, help="frames per second written, all of them streamed")
    p.add_argument("--cap-mb", type=float, default=1.0, help="the app's 'Stream videos under a KV cap' (MB)")
    p.add_argument("--methods", default="full,infinipot_v", help="comma-separated; full streams without a cap")
    p.add_argument("--model", default="tiny-arena-vl")
    p.add_argument("--seed", type=int, default=0, help="which held-out scene (the first, with --videos)")
    p.add_argument("--videos", type=int, default=1, help="held-out scenes asked one after another (--seed on), "
                   "each in a new session of the same app; the table ends with each method's right answers")
    p.add_argument("--question", default="long_moving", choices=("moving",) + LONG_TYPES,
                   help="long_moving, glimpse: v3.1's long videos, their drawn frames sampled back from the "
                        "whole video; moving: v3's scene slowed down, every frame streamed")
    p.add_argument("--out", default=None, help="folder to keep the video and the app's logs in (default: a "
                   "temporary one, removed at the end)")
    return p.parse_args(argv)


def draw_video(path: Path, minutes: float, fps: int, seed: int, question: str = "moving") -> tuple[str, str, int, int]:
    """A held-out scene of type ``question`` lasting ``minutes``: (question, answer, frames written,
    frames to ask the app for: every one for v3's moving scene, the drawn ones for a long video)."""
    import numpy as np

    from kv_arena.media import write_avi
    from kv_arena.tiny import generations

    if question == "moving":
        item = generations.of().scenes.held_out("moving", seed + 1)[seed]
    else:
        item = held_out_long(question, seed + 1, turns=1, minutes=minutes)[seed]
    drawn = item.frames()
    count = round(minutes * 60 * fps)
    if count < len(drawn):
        raise SystemExit(f"error: {minutes:g} min at {fps} fps is {count} frames, fewer than the {len(drawn)} drawn")
    frames = drawn[held_frames(count, len(drawn)) if question != "moving" else np.arange(count) * len(drawn) // count]
    write_avi(path, frames, fps=fps)
    return item.question.text, item.question.answer, count, count if question == "moving" else len(drawn)


def held_frames(count: int, drawn: int):
    """For each of ``count`` frames written, the drawn frame it shows: the one whose moment the app's
    sampling for ``drawn`` frames (kv_arena.media.sampled_frames) takes nearest, so the app gets the
    drawn frames back one for one (each held about an equal share of the time, the first and last half)."""
    import numpy as np

    return np.rint(np.arange(count) * (drawn - 1) / max(1, count - 1)).astype(int)


def resident(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current resident set


def start_app(model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``python app.py`` on a free port, its output in ``log``; returns once it answers."""
    port = free_port()
    env = os.environ | {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "KV_ARENA_MODEL": model}
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}/"
    import urllib.request

    for _ in range(240):
        if server.poll() is not None:
            raise SystemExit(f"error: the app did not start; see {log}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return server, url
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit("error: the app did not answer within 120 s")


def ask(url: str, pid: int, video: Path, question: str, frames: int, model: str, method: str, cap_mb: float) -> dict:
    """One ``/chat`` call in a new session: the app's status line, parsed, and the server's memory."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False)
    before = resident(pid, "VmRSS")
    reset_peak(pid)
    start = time.perf_counter()
    history, _, status, *_ = client.predict(
        message={"text": question, "files": [handle_file(str(video))]}, history=[], model=model, method=method,
        num_frames=frames, stream_cap_mb=cap_mb, max_new_tokens=8, api_name="/chat")
    wall = time.perf_counter() - start
    stream = STATUS["stream"].search(status)
    if stream is None:
        raise SystemExit(f"error: {method}: the app did not stream the video: {status[:300]}")
    return {"method": method, "frames": int(stream[1]), "chunks": int(stream[2]), "cap": stream[3] or "-",
            "peak_kv": stream[4] or stream[5], "kv_end": STATUS["kv"].search(status)[1],
            "first_token_s": float(STATUS["first_token"].search(status)[1]), "wall_s": wall,
            "rss_before": before, "rss_peak": resident(pid, "VmHWM"), "answer": text_of(history[-1]["content"])}


def text_of(content) -> str:
    """A chat message's text: a string, or Gradio's list of parts."""
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if isinstance(part, dict))


def decoded_whole(video: Path, frames: int) -> tuple[int, int]:
    """(bytes of the frames, growth of this process's resident set) when the clip is decoded at once."""
    from kv_arena.media import load_video

    before = resident(os.getpid(), "VmRSS")
    clip = load_video(str(video), frames)
    return clip.frames.nbytes, resident(os.getpid(), "VmRSS") - before


def main(argv=None) -> int:
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.minutes <= 0 or args.fps < 1 or args.cap_mb <= 0 or args.videos < 1 or not methods:
        print("error: --minutes and --cap-mb must be positive, --fps and --videos at least 1, --methods not empty",
              file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        return measure(args, methods, Path(args.out))
    with tempfile.TemporaryDirectory(prefix="kv-arena-long-video-") as folder:  # the video is large: gone after
        return measure(args, methods, Path(folder))


def measure(args, methods: list[str], folder: Path) -> int:
    from kv_arena.bench.accuracy import is_right

    videos = []  # (path, question, true answer, frames asked for)
    for seed in range(args.seed, args.seed + args.videos):
        video = folder / f"long_video_{seed}.avi"
        question, truth, written, frames = draw_video(video, args.minutes, args.fps, seed, args.question)
        videos.append((video, question, truth, frames))
        print(f"{video}: {args.minutes:g} min at {args.fps} fps, {written} frames, {video.stat().st_size / MB:.1f} MB, "
              f"{frames} of them asked for; '{question}' (true answer: {truth})")
    size, grown = decoded_whole(videos[0][0], videos[0][3])
    print(f"the first decoded whole: {size / MB:.1f} MB of frames, this process grew by {grown / MB:.1f} MB; "
          f"model {args.model}; cap {args.cap_mb:g} MB", flush=True)
    rows = []
    for method in methods:  # a fresh app for each: its memory is that method's alone
        log = folder / f"app-{method}.log"
        server, url = start_app(args.model, log)
        try:
            for k, (video, question, truth, frames) in enumerate(videos):
                row = ask(url, server.pid, video, question, frames, args.model, method, args.cap_mb)
                rows.append({**row, "video": args.seed + k, "right": is_right(row["answer"], truth)})
        except Exception as exc:  # noqa: BLE001 - the app's own failure: its log says why
            tail = "".join(log.read_text().splitlines(keepends=True)[-8:])
            print(f"error: {method}: {exc.__class__.__name__}: {str(exc)[:200]}; the app's log ends:\n{tail}",
                  file=sys.stderr)
            return 1
        finally:
            server.terminate()
            server.wait(timeout=30)
    cells = [["method", "video", "frames", "chunks", "cap", "peak KV", "KV after the answer", "first token s", "call s",
              "server RSS before MB", "server peak RSS MB", "answer"]]
    for r in rows:
        cells.append([r["method"], str(r["video"]), str(r["frames"]), str(r["chunks"]), r["cap"], r["peak_kv"],
                      r["kv_end"], f"{r['first_token_s']:.1f}", f"{r['wall_s']:.1f}", f"{r['rss_before'] / MB:.0f}",
                      f"{r['rss_peak'] / MB:.0f}", f"{r['answer']} ({'right' if r['right'] else 'wrong'})"])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    print("right answers: " + ", ".join(f"{m} {sum(r['right'] for r in rows if r['method'] == m)}/{len(videos)}"
                                        for m in methods))
    return 0

if __name__ == "__main__":
    sys.exit(main())
