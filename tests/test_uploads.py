"""The uploads ledger: a file is used by, and served to, only the client that uploaded it, however
its path travels (a re-upload of the same bytes by its owner opens nothing to anyone else)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from tests.support import make_image

from kv_arena import service
from kv_arena.errors import UserError
from kv_arena.service import uploads


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """Gradio's upload folder of this test, and a ledger of its own (an application state)."""
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    with service.using_app(service.AppState()):
        yield tmp_path


def upload(folder, name: str, seed: int) -> str:
    path = folder / name[:4] / name
    path.parent.mkdir()
    make_image(seed, (32, 32)).save(path)
    return str(path)


def session(client: str | None):
    return SimpleNamespace(id=f"tab-of-{client}", client=client, uploads=set())


def test_only_the_uploading_client_uses_and_reads_a_file_even_after_it_uploads_it_again(folder):
    path = upload(folder, "a-photo.png", 21)
    uploads.note_uploads([path], "client-a")
    uploads.note_uploads([path], "client-a")  # gradio_client sends a history's files again with each turn
    owner, other, cookieless = session("client-a"), session("client-b"), session(None)
    uploads.check_uploads(owner, [path])
    for stranger in (other, cookieless):
        with pytest.raises(UserError, match="was not uploaded in this session"):
            uploads.check_uploads(stranger, [path])
    assert uploads.may_read(path, "client-a")
    assert not uploads.may_read(path, "client-b") and not uploads.may_read(path, None)
    uploads.forget_uploads(owner)  # the tab closed: the file goes
    assert not (folder / "a-ph" / "a-photo.png").exists()


def test_an_upload_without_a_client_serves_the_first_session_that_names_it(folder):
    path = upload(folder, "anon.png", 22)
    uploads.note_uploads([path], None)  # a raw HTTP client that keeps no cookies
    first, second = session(None), session("client-c")
    uploads.check_uploads(first, [path])
    uploads.check_uploads(first, [path])  # its own, again
    with pytest.raises(UserError):
        uploads.check_uploads(second, [path])
    assert not uploads.may_read(path, "client-c")


def test_the_shipped_examples_are_public(folder):
    copy = folder / "exam" / "scene_colour.png"
    copy.parent.mkdir()
    shutil.copy(uploads.ASSETS / "scene_colour.png", copy)
    uploads.note_uploads([str(copy)], "client-d")  # uploaded by someone, still the example everyone may use
    uploads.check_uploads(session("client-e"), [str(copy)])
    assert uploads.may_read(str(copy), "client-e")


def blob(folder, i: int, size: int) -> str:
    path = folder / f"blob{i}" / f"blob{i}.bin"
    path.parent.mkdir()
    path.write_bytes(i.to_bytes(4, "big") + bytes(size - 4))
    return str(path)


def test_unused_uploads_are_capped_per_visitor_and_in_all_and_a_used_one_no_longer_counts(folder, monkeypatch):
    monkeypatch.setenv("KV_ARENA_MAX_UNUSED_UPLOAD_MB", "1")
    monkeypatch.setenv("KV_ARENA_MAX_UNUSED_UPLOADS_MB", "4")
    third = 2**20 // 3
    a = [blob(folder, i, third) for i in range(4)]
    assert uploads.note_uploads(a[:3], "client-a", "visitor:a") is None  # 1 MB less a byte or two: fits
    assert "over the 1 MB allowed" in uploads.note_uploads([a[3]], "client-a2", "visitor:a")  # a fresh cookie
    assert not (folder / "blob3" / "blob3.bin").exists()  # refused: its file is gone, nothing was noted
    assert not uploads.may_read(a[3], "client-a2")
    assert uploads.note_uploads(a[:1], "client-a", "visitor:a") is None  # the same bytes again add nothing
    assert uploads.upload_room("client-x", 2**20, "visitor:a") is not None
    assert uploads.upload_room("client-b", 2**20, "visitor:b") is None
    uploads.check_uploads(session("client-a"), a[:3])  # sent in a message: they no longer count
    assert uploads.note_uploads([blob(folder, 4, third)], "client-a", "visitor:a") is None
    for n, name in enumerate("bcdef"):  # other visitors, three files each; the total is 4 MB
        refused = uploads.note_uploads([blob(folder, 10 + 3 * n + k, third) for k in range(3)], None, f"visitor:{name}")
        if refused:
            break
    assert n == 3 and "this server holds all the files" in refused and "4 MB" in refused


def test_a_visitor_keeps_at_most_a_quarter_of_the_total_and_a_few_files(folder, monkeypatch):
    monkeypatch.setenv("KV_ARENA_MAX_UNUSED_UPLOAD_MB", "1000")
    monkeypatch.setenv("KV_ARENA_MAX_UNUSED_UPLOADS_MB", "1")
    monkeypatch.setenv("KV_ARENA_MAX_UNUSED_UPLOAD_FILES", "3")
    quarter = 2**20 // 4
    assert uploads.note_uploads([blob(folder, 0, quarter)], None, "visitor:a") is None
    assert "over the 0 MB allowed" in uploads.note_uploads([blob(folder, 1, 16)], None, "visitor:a")
    tiny = [blob(folder, i, 16) for i in range(10, 14)]
    assert all(uploads.note_uploads([t], "cookie-b", "visitor:b") is None for t in tiny[:3])
    refused = uploads.note_uploads([tiny[3]], "cookie-b", "visitor:b")
    assert "you have 4 files not yet sent in a message, over the 3 allowed" in refused and "\n" not in refused
    # a classmate behind the same address has files of its own (issue 68); fresh cookies meet the address's cap
    monkeypatch.setenv("KV_ARENA_MAX_UNUSED_UPLOAD_FILES_PER_ADDRESS", "5")
    assert uploads.note_uploads([tiny[3]], "cookie-classmate", "visitor:b") is None
    more = [blob(folder, i, 16) for i in range(30, 33)]
    assert uploads.note_uploads([more[0]], "cookie-new", "visitor:b") is None
    refused = uploads.note_uploads([more[1]], "cookie-newer", "visitor:b")
    assert "the people behind your address" in refused and "(5 files)" in refused, refused
    assert uploads.note_uploads([blob(folder, 20, 16)], None, "visitor:c") is None  # the others still have room
