"""Who may read the public app's files, through real app processes where processes are the point
(``python app.py`` on one temp folder: two replicas, a restart; ``tools/app_process.py``) and raw
HTTP, on 127.0.0.1 only: a replica and a restarted app serve no file they hold no record of,
whatever the cookie; a drawn scene ("New scene") is served to its own client only."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.support import make_image
from tests.test_app_client import free_port
from tests.test_app_hostile import chat_data, file_data, raw_event, raw_upload, spellings
from tools.app_process import AppProcess


def fn_index_at(url: str, name: str) -> int:
    """The index of the event named ``name``, from the app's page config (as a browser reads it)."""
    config = httpx.get(f"{url}config", timeout=10).json()
    return next(d["id"] for d in config["dependencies"] if d.get("api_name") == name)


def status(url: str, cookies=None) -> int:
    return httpx.get(url, cookies=cookies, timeout=10).status_code


def test_a_replica_and_a_restarted_app_serve_no_file_they_cannot_prove_is_the_callers(tmp_path):
    """Two replicas on one temp folder, then the first started again: an upload, its overlay and an
    upload not yet used are served by the first process to their client, and by no other process to
    anyone (no cookie, another's, even the owner's: that ownership is known to another process only)."""
    host_tmp = tmp_path / "host-tmp"
    pictures = [tmp_path / "used.png", tmp_path / "unused.png"]
    for seed, picture in enumerate(pictures):
        make_image(40 + seed, (112, 112)).save(picture)
    first, second = AppProcess(host_tmp).launch(), AppProcess(host_tmp).launch()
    try:
        first.wait(), second.wait()
        with httpx.Client() as owner:
            owner.get(first.url, timeout=10)  # the client's cookie
            used, unused = (raw_upload(owner, first.url, str(p)) for p in pictures)
            answer = raw_event(first.url, fn_index_at(first.url, "chat"),
                               chat_data({"text": "Mine?", "files": [file_data(used)]}, method="snapkv"),
                               uuid.uuid4().hex[:11], http=owner)
            assert answer["success"], answer
            overlay = answer["output"]["data"][7][0]["image"]["path"]
            files = (used, overlay, unused)
            for path in files:
                assert status(f"{first.url}gradio_api/file={path}", owner.cookies) == 200, path
                assert status(f"{first.url}gradio_api/file={path}") == 404, path
            for path in files:
                for route in spellings(path):
                    for cookies in (None, owner.cookies):
                        assert status(second.url + route, cookies) == 404, (route, bool(cookies))
            first.stop()
            with AppProcess(host_tmp) as again:  # the first one, restarted on the same folder
                for path in files:
                    for route in spellings(path):
                        for cookies in (None, owner.cookies):
                            assert status(again.url + route, cookies) == 404, (route, bool(cookies))
    finally:
        first.stop(), second.stop()


# --- drawn scenes: one app launched in this process (nothing here is about processes) -------------
@pytest.fixture(scope="module")
def server():
    """(demo, url) of one launched app."""
    from app import build_demo, launch_options

    demo = build_demo()
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                            quiet=True, **launch_options())
    yield demo, url
    demo.close()


def test_a_drawn_scene_is_served_to_its_own_client_only(server):
    demo, url = server
    index = next(i for i, fn in demo.fns.items() if fn.name == "new_scene")
    with httpx.Client() as owner, httpx.Client() as other:
        for client in (owner, other):
            client.get(url, timeout=10)
        answer = raw_event(url, index, ["colour", None], uuid.uuid4().hex[:11], http=owner)
        assert answer["success"], answer
        drawn = [f["path"] for f in answer["output"]["data"][0]["files"]]
        assert drawn
        for path in drawn:
            assert status(f"{url}gradio_api/file={path}", owner.cookies) == 200
            for route in spellings(path):
                assert status(url + route, other.cookies) == 404, route
                assert status(url + route) == 404, route
