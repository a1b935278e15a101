"""Who may read the public app's files, through the launched app and raw HTTP, on 127.0.0.1 only:
a drawn scene ("New scene") is served to its own client only."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.test_app_client import free_port
from tests.test_app_hostile import raw_event, spellings


def status(url: str, cookies=None) -> int:
    return httpx.get(url, cookies=cookies, timeout=10).status_code


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
