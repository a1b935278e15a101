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
    copy = folder / "exam" / "arena_colour.png"
    copy.parent.mkdir()
    shutil.copy(uploads.ASSETS / "arena_colour.png", copy)
    uploads.note_uploads([str(copy)], "client-d")  # uploaded by someone, still the example everyone may use
    uploads.check_uploads(session("client-e"), [str(copy)])
    assert uploads.may_read(str(copy), "client-e")
