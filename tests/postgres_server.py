"""A throwaway PostgreSQL server for the tests, from Debian's ``postgresql`` package (``initdb``
and ``postgres`` under /usr/lib/postgresql/<version>/bin, or on the PATH): a fresh cluster in a
temporary folder, on 127.0.0.1 and a free port, trusting local connections. Run as root, it runs
as the ``postgres`` user (PostgreSQL refuses root). :meth:`kill` ends it at once, as a crash
would; :meth:`start` brings it back on the same folder and port."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def binaries() -> Path | None:
    """The folder holding ``initdb`` and ``postgres``, or None where PostgreSQL is not installed."""
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(folder, "initdb").is_file() and Path(folder, "postgres").is_file():
            return Path(folder)
    found = shutil.which("postgres")
    return Path(found).parent if found and shutil.which("initdb") else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPostgres:
    """``with LocalPostgres() as db:`` a server at ``db.url`` (SQLAlchemy's form)."""

    def __init__(self) -> None:
        self.bin = binaries()
        if self.bin is None:
            raise FileNotFoundError("no PostgreSQL (initdb, postgres) installed")
        self.user = "postgres" if os.geteuid() == 0 else None
        self.folder = Path(tempfile.mkdtemp(prefix="kv-arena-pg-"))
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        self.data = self.folder / "data"
        self.port = free_port()
        self.url = f"postgresql://kvarena@127.0.0.1:{self.port}/postgres"
        self.process: subprocess.Popen | None = None
        subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "kvarena", "--auth=trust", "-E", "UTF8"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, user=self.user)
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
             "-k", str(self.folder), "-c", "fsync=off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            user=self.user)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("the local PostgreSQL server ended at start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    time.sleep(0.3)  # the port opens a moment before connections are taken
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the local PostgreSQL server did not start")

    def kill(self) -> None:
        """SIGKILL: gone mid-whatever, as in a crash (the next start recovers from its WAL)."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LocalPostgres:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
