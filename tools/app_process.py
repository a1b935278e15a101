"""``python app.py`` as a process of its own, on 127.0.0.1 and a free port, with the temp folder it
is given (``TMPDIR``): two of them on one folder are two replicas on one host (docs/mpic_store.md),
one started again on the folder another left is a restart. For the tools and the tests that need a
real app process (what one process leaves to another)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what would point this process's files elsewhere than the temp folder it is given
PLACED = ("GRADIO_TEMP_DIR", "KV_ARENA_KV_STORE", "KV_ARENA_KV_STORE_URL")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppProcess:
    """One app process: started by :meth:`start` (or ``with``), answering at :attr:`url`."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None, model: str = "tiny-qwen2-vl") -> None:
        self.tmp = Path(tmp)
        self.env = {k: v for k, v in os.environ.items() if k not in PLACED} | {
            "TMPDIR": str(self.tmp), "GRADIO_SERVER_NAME": "127.0.0.1", "KV_ARENA_MODEL": model,
            "KV_ARENA_PRELOAD": "0", "OMP_NUM_THREADS": "1", **(env or {})}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.process: subprocess.Popen | None = None

    def launch(self) -> AppProcess:
        """Start the process without waiting for it (:meth:`wait`): several start side by side."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        with open(self.tmp / f"app-{self.port}.log", "w") as log:
            self.process = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env | {"GRADIO_SERVER_PORT": str(self.port)})
        return self

    def wait(self, timeout: float = 120) -> AppProcess:
        """Until the app answers its page (its log's tail in the error if it ends or never does)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url, timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"app.py did not answer on {self.url}: {self.log()[-2000:]}")

    def start(self) -> AppProcess:
        return self.launch().wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return (self.tmp / f"app-{self.port}.log").read_text(errors="replace")

    def __enter__(self) -> AppProcess:
        return self if self.process is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
