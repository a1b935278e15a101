"""A throwaway Valkey or Redis server for the tests and ``--mode mpic``'s server row: started on a
free local port in a temporary folder, without persistence, and gone when the block ends."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str | None:
    """The first Valkey or Redis server on the PATH, or None."""
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``with LocalServer() as server:`` a server at ``server.url``; ``extra`` are its own options
    (``["--maxmemory", "1mb"]``). :meth:`kill` ends it at once, as a crash would."""

    def __init__(self, extra: list[str] | None = None):
        binary = server_binary()
        if binary is None:
            raise FileNotFoundError("no valkey-server or redis-server on the PATH")
        self.folder = tempfile.mkdtemp(prefix="kv-arena-valkey-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.folder, *(extra or [])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, limit_s: float = 10.0) -> None:
        client, deadline = redis.Redis(port=self.port, socket_timeout=1), time.monotonic() + limit_s
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the local Valkey/Redis server did not start") from None
                time.sleep(0.05)
            finally:
                client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: the server is gone mid-whatever, as in a crash."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
