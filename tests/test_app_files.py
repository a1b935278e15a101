"""Who may read the public app's files, and how much of them may wait unused, through real app
processes where processes are the point (``python app.py`` on one temp folder: two replicas, a
restart; ``tools/app_process.py``) and raw HTTP, on 127.0.0.1 only: a replica and a restarted app
serve no file they hold no record of, whatever the cookie; one client's unused uploads and
everyone's are capped, and none outlive a restart; a drawn scene ("New scene") is served to its own
client only."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.support import make_image
from tests.app_support import launched_app
from tests.test_app_hostile import chat_data, file_data, raw_event, raw_upload, spellings
from tools.app_process import AppProcess
from tools.upload_flood import flood, kept_bytes

MB = 2**20


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


def test_unused_uploads_are_capped_per_visitor_and_in_all_and_none_outlive_a_restart(tmp_path):
    """The audit's flood, scaled down (``python -m tools.upload_flood`` runs it at 20 x 50 MB with the
    default caps): behind one trusted proxy, one visitor sends 20 uploads of 2 MB under a 10 MB cap
    per visitor and 40 MB in all, a fresh connection (no cookie) each; a fresh cookie is the same
    visitor; then other visitors meet the total."""
    caps = {"KV_ARENA_MAX_UNUSED_UPLOAD_MB": "10", "KV_ARENA_MAX_UNUSED_UPLOADS_MB": "40",
            "KV_ARENA_TRUSTED_PROXY_HOPS": "1"}
    host_tmp = tmp_path / "host-tmp"

    def visitor(address: str) -> httpx.Client:  # the proxy's entry last, after one the client forged
        return httpx.Client(headers={"x-forwarded-for": f"192.0.2.9, {address}"})

    with AppProcess(host_tmp, caps) as app:
        answers = [flood(app.url, 1, 2, visitor("203.0.113.5"), first=i)[0] for i in range(20)]
        assert [a.status_code for a in answers] == [200] * 5 + [413] * 15
        line = answers[-1].text
        assert "\n" not in line and "over the 10 MB allowed" in line, line
        after_flood = kept_bytes(host_tmp)
        assert after_flood == 10 * MB
        with visitor("203.0.113.5") as again:
            again.get(app.url, timeout=10)  # a cookie of its own: still the same visitor
            assert [r.status_code for r in flood(app.url, 1, 2, again, first=50)] == [413]
        with visitor("198.51.100.1") as b, visitor("198.51.100.2") as c, visitor("198.51.100.3") as d:
            assert [r.status_code for r in flood(app.url, 5, 2, b, first=100)] == [200] * 5
            assert [r.status_code for r in flood(app.url, 6, 2, c, first=200)] == [200] * 5 + [413]
            answers = flood(app.url, 6, 2, d, first=300)  # 30 MB kept, then 40: all the server keeps
            assert [r.status_code for r in answers] == [200] * 5 + [413]
        with visitor("198.51.100.4") as e:
            answers = flood(app.url, 1, 2, e, first=400)
            assert [r.status_code for r in answers] == [413]
            assert "this server holds all the files" in answers[-1].text, answers[-1].text
        assert kept_bytes(host_tmp) == 40 * MB
    with AppProcess(host_tmp, caps):  # a restart on the same folder
        after_restart = kept_bytes(host_tmp)
    print(f"\nunused uploads kept on disk: {after_flood / MB:.0f} MB of one visitor's 40 MB flood, "
          f"{after_restart / MB:.0f} MB after a restart")
    assert after_restart == 0


# --- drawn scenes: one app launched in this process (nothing here is about processes) -------------
@pytest.fixture(scope="module")
def server():
    """(demo, url) of one launched app."""
    with launched_app() as launched:
        yield launched


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


def test_the_pictures_an_answer_shows_are_served_to_its_client_only(server, tmp_path):
    """Gradio's copy of a picture the chat shows (in its cache, named by the file's hash) reaches the
    client the answer went to, and no other client, nor one without a cookie."""
    from gradio_client import Client

    from tests.test_app_client import send

    _, url = server
    picture = tmp_path / "mine.png"
    make_image(5, (112, 112)).save(picture)
    client = Client(url, verbose=False, download_files=False)
    final, _ = send(client, "What is in the picture?", [str(picture)])
    shown = [part["file"] for m in final[0] for part in (m["content"] if isinstance(m["content"], list) else [])
             if isinstance(part, dict) and "file" in part]
    shown = [f["path"] if isinstance(f, dict) else f for f in shown]  # a FileData without downloads
    assert shown
    with httpx.Client() as other:
        other.get(url, timeout=10)
        for path in shown:
            assert status(f"{url}gradio_api/file={path}", client.cookies) == 200
            assert status(f"{url}gradio_api/file={path}", other.cookies) == 404
            assert status(f"{url}gradio_api/file={path}") == 404
