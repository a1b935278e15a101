"""What the app itself adds to an answer: drive ``/chat`` and ``/compare`` with gradio_client and
print, per method, the wall time of the call against the model's own time (time to first token and
decode, of the method and of the full-cache reference when it was computed for that call), as the
app reports them (the chat's status line, the Compare table's "Answer (s)" column). The first row
is Gradio's own floor on the machine: an app that only echoes the same message back. A "switch"
row asks a follow-up with the method switched (the history sent back as /chat returned it): the
new method's re-read of the conversation, as the chat's switch line reports it, is its own column
and counts as model time.

    python -m tools.app_cost                      # starts the app in this process (offline model)
    python -m tools.app_cost --url http://127.0.0.1:7860/ --repeats 5

Each repeat asks one example question as a new conversation (a new client: a new session, so the
full-cache reference is computed again, as for a new visitor); the first call of each endpoint is
a warm-up and not counted. Medians over ``--repeats``. The tool is one visitor asking dozens of
switches a minute, past the app's re-read limit for one visitor: the app it starts lifts that limit
(``KV_ARENA_REREAD_TOKENS_PER_MINUTE``), and an app given with ``--url`` needs it set as high. Lives
outside ``kv_arena/`` because it drives the UI (the engine never imports gradio). Exit code 2 and one
line for bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL_TIME = re.compile(r"model time ([\d.]+) s(?: \+ ([\d.]+) s for the full-cache reference)?")
REREAD = re.compile(r"re-read the \d+ turns? above \(\d+ tokens, ([\d.]+) s\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app() -> tuple[str, object]:
    from app import build_demo, launch_options

    demo = build_demo()
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options())
    return url, demo


def start_echo() -> tuple[str, object]:
    """Gradio's own floor on this machine: an event taking the same message (an upload) and
    streaming two outputs back, doing nothing else."""
    import gradio as gr

    def echo(message, history):
        yield "…"
        yield message["text"]

    with gr.Blocks() as demo:
        box, chat, out = gr.MultimodalTextbox(), gr.Chatbot(), gr.Textbox()
        box.submit(echo, [box, chat], out, api_name="chat")
    demo.queue()
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    return url, demo


def echo_once(url: str, text: str, files: list[str]) -> tuple[float, float]:
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False)
    start = time.perf_counter()
    client.predict({"text": text, "files": [handle_file(f) for f in files]}, [], api_name="/chat")
    return time.perf_counter() - start, 0.0


def chat_once(url: str, model: str, method: str, budget: float, text: str, files: list[str]) -> tuple[float, float]:
    """(wall s, model s) of one ``/chat`` call in a fresh session."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False)  # a browser shows the text before it fetches images
    start = time.perf_counter()
    result = client.predict(message={"text": text, "files": [handle_file(f) for f in files]}, history=[],
                            model=model, method=method, budget=budget, api_name="/chat")
    wall = time.perf_counter() - start
    found = MODEL_TIME.search(result[2])
    if not found:
        raise SystemExit(f"error: the chat's status line has no model time: {result[2][:300]}")
    return wall, float(found.group(1)) + float(found.group(2) or 0)


def switch_once(url: str, model: str, method: str, budget: float, text: str, then: str,
                files: list[str]) -> tuple[float, float, float]:
    """(wall s, model s, re-read s) of a follow-up sent with ``method`` after a first answer by the
    full cache, in a fresh session: the conversation switched, re-read by ``method`` first."""
    from gradio_client import Client, handle_file

    from kv_arena import service

    client = Client(url, verbose=False, download_files=False)
    first = client.predict(message={"text": text, "files": [handle_file(f) for f in files]}, history=[],
                           model=model, method=service.reference_spec()["name"], api_name="/chat")
    start = time.perf_counter()
    result = client.predict(message={"text": then, "files": []}, history=first[0], model=model, method=method,
                            budget=budget, api_name="/chat")
    wall = time.perf_counter() - start
    said, found = str(result[0]), MODEL_TIME.search(result[2])
    reread = REREAD.search(said)
    if not found or not reread:
        raise SystemExit(f"error: no switch or no model time in the reply: {result[2][:300]}")
    return wall, float(found.group(1)) + float(found.group(2) or 0) + float(reread.group(1)), float(reread.group(1))


def compare_once(url: str, model: str, methods: list[str], budget: float, text: str, then: str,
                 files: list[str]) -> tuple[float, float]:
    """(wall s, model s) of one ``/compare`` call in a fresh session: the model's time is the sum of
    the table's "Answer (s)" over every run and turn (the full cache's counted unless cached)."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False)  # a browser shows the text before it fetches images
    start = time.perf_counter()
    result = client.predict(message={"text": text, "files": [handle_file(f) for f in files]}, follow_up=then,
                            methods=methods, model=model, budget=budget, api_name="/compare")
    wall = time.perf_counter() - start
    grid = next(r for r in result if isinstance(r, dict) and "headers" in r)
    answer = grid["headers"].index("Answer (s)")
    return wall, sum(float(row[answer]) for row in grid["data"] if not str(row[0]).endswith("(cached)"))


def median_row(name: str, samples: list[tuple]) -> list[str]:
    """Medians of (wall, model[, re-read]) samples: wall, model, what the app adds, the re-read."""
    wall = statistics.median(s[0] for s in samples)
    model = statistics.median(s[1] for s in samples)
    extra = statistics.median(s[0] - s[1] for s in samples)
    reread = f"{statistics.median(s[2] for s in samples):.3f}" if len(samples[0]) > 2 else ""
    return [name, f"{wall:.3f}", f"{model:.3f}", f"{extra:.3f}", reread]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running app (default: start one here)")
    p.add_argument("--model", default="tiny-arena-vl")
    p.add_argument("--methods", default="full,streamingllm,h2o,snapkv,attention_pack,elastic_cache")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.repeats < 1 or not 0 < args.budget <= 1:
        print("error: --repeats must be at least 1 and --budget in (0, 1]", file=sys.stderr)
        return 2
    if not args.url:  # what a switch costs is measured, not one visitor's re-read limit (read on import)
        os.environ.setdefault("KV_ARENA_REREAD_TOKENS_PER_MINUTE", str(10**9))
    from kv_arena import service

    scene = service.scene_examples()[0] if service.is_trained_here(args.model) else None
    text, then, files = ((scene.questions[0], scene.questions[-1], list(scene.files)) if scene else
                         ("What shapes do you see?", "What colour is the triangle?", [str(ROOT / "assets/shapes.png")]))
    methods = [m for m in args.methods.split(",") if m]
    rows = [["call", "wall (s)", "model (s)", "app adds (s)", "re-read (s)"]]
    echo_url, echo_demo = start_echo()
    try:
        echo_once(echo_url, text, files)  # warm-up
        rows.append(median_row("Gradio alone (an echo, same upload)",
                               [echo_once(echo_url, text, files) for _ in range(args.repeats)]))
    finally:
        echo_demo.close()
    url, demo = (args.url, None) if args.url else start_app()
    try:
        for method in methods:
            chat_once(url, args.model, method, args.budget, text, files)  # warm-up
            rows.append(median_row(f"/chat {method}", [chat_once(url, args.model, method, args.budget, text, files)
                                                       for _ in range(args.repeats)]))
        for method in [m for m in methods if not service.is_reference(m)]:
            rows.append(median_row(f"/chat switch full -> {method}", [switch_once(url, args.model, method, args.budget,
                                                                                  text, then, files)
                                                                      for _ in range(args.repeats)]))
        compared = [m for m in methods if not service.is_reference(m)][:service.MAX_COMPARE]
        compare_once(url, args.model, compared, args.budget, text, then, files)  # warm-up
        rows.append(median_row(f"/compare {','.join(compared)} (2 turns)",
                               [compare_once(url, args.model, compared, args.budget, text, then, files)
                                for _ in range(args.repeats)]))
    finally:
        if demo is not None:
            demo.close()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"model {args.model}, budget {args.budget}, '{text}' then '{then}', medians of {args.repeats}; "
          "model = the method's and the full-cache reference's time to first token and decode, and a switch's re-read")
    for row in rows:
        print("  ".join([row[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(row[1:], widths[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
