"""Uploads that no event ever uses, as one client without cookies sends them (raw HTTP, a fresh
connection each), against ``python app.py`` on a temp folder of its own: how many the app took, how
many it refused, and the bytes of them kept on disk after the flood and after the app is started
again on the same folder (a restart).

    python -m tools.upload_flood                      # 20 x 50 MB, the app's default caps
    python -m tools.upload_flood --count 8 --mb 5 --env KV_ARENA_MAX_UNUSED_UPLOAD_MB=12

Each file is distinct (Gradio names an upload by a hash of its bytes: identical ones would be one
file). Exit code 2 and one line for bad input. Lives outside ``kv_arena/``: it drives the app.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tools.app_process import AppProcess

NAME = "flood-{}.bin"  # the files this tool uploads, found on disk by their names


def payload(i: int, size: int) -> bytes:
    """``size`` bytes, distinct for each ``i``."""
    return i.to_bytes(8, "big") + bytes(max(0, size - 8))


def upload(url: str, i: int, size: int, http: httpx.Client | None = None) -> httpx.Response:
    """One upload of file ``i``; ``http`` None: a fresh client, which sends no cookie."""
    files = [("files", (NAME.format(i), payload(i, size)))]
    if http is None:
        with httpx.Client() as fresh:
            return fresh.post(f"{url}gradio_api/upload", files=files, timeout=120)
    return http.post(f"{url}gradio_api/upload", files=files, timeout=120)


def flood(url: str, count: int, mb: float, http: httpx.Client | None = None, first: int = 0) -> list[httpx.Response]:
    return [upload(url, i, int(mb * 2**20), http) for i in range(first, first + count)]


def kept_bytes(folder: Path) -> int:
    """Bytes of this tool's uploads on disk under ``folder`` (an app's temp folder)."""
    return sum(p.stat().st_size for p in Path(folder).rglob(NAME.format("*")) if p.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=20, help="uploads (default 20)")
    p.add_argument("--mb", type=float, default=50, help="size of each, MB (default 50)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the app, repeatable")
    args = p.parse_args(argv)
    if args.count < 1 or not 0 < args.mb <= 4096 or any("=" not in e for e in args.env):
        print("error: --count must be at least 1, --mb in (0, 4096], --env NAME=VALUE", file=sys.stderr)
        return 2
    env = dict(e.split("=", 1) for e in args.env)
    with tempfile.TemporaryDirectory(prefix="kv-arena-flood-") as tmp:
        with AppProcess(Path(tmp), env) as app:
            start = time.monotonic()
            answers = flood(app.url, args.count, args.mb)
            took = time.monotonic() - start
            taken = sum(a.status_code == 200 for a in answers)
            refused = [a for a in answers if a.status_code == 413]
            print(f"{args.count} uploads of {args.mb:g} MB without cookies in {took:.1f} s: {taken} taken, "
                  f"{len(refused)} refused (413), others {args.count - taken - len(refused)}")
            if refused:
                print(f"refusal: {refused[0].text}")
            print(f"kept on disk after the flood: {kept_bytes(Path(tmp)) / 2**20:.0f} MB")
        with AppProcess(Path(tmp), env):
            print(f"kept on disk after a restart: {kept_bytes(Path(tmp)) / 2**20:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
