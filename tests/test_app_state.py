"""The application state: everything the service remembers lives in one object that the app (or
a test) opens; two of them share nothing, and a forked GPU worker opens the store anew without
sweeping the folders of its parent's sessions."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from kv_arena import service
from kv_arena.mpic.kv_store import KVStore
from kv_arena.service import AppState, instance, scenes, sessions, store, uploads

FORK = multiprocessing.get_context("fork")


def test_two_application_states_share_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    first, second = AppState(), AppState()
    with service.using_app(first):
        tab = service.Session()
        service.track(tab, "tab-hash", client="client-a")
        drawn = service.draw_scene(service.scene_types()[0], seed=1, owner=tab.id)
        media = scenes.media_digest(drawn.files)
        assert service.open_session("tab-hash") is tab and scenes.scene_of(media) == drawn
        assert store.tenant_of(tab.id) == "client:client-a"
    with service.using_app(second):
        assert service.current_app() is second
        assert service.open_session("tab-hash") is None and scenes.scene_of(media) is None
        assert store.tenant_of(tab.id) == tab.id
    with service.using_app(first):
        service.release("tab-hash")
        assert service.open_session("tab-hash") is None and store.tenant_of(tab.id) == tab.id
    assert service.current_app() not in (first, second)  # the block's end puts the previous one back


def test_a_stop_asked_is_seen_by_the_application_that_holds_the_session():
    with service.using_app(AppState()):
        tab = service.Session()
        tab.stop_requested = True
        assert sessions.stopping(tab.id)
    assert not sessions.stopping(tab.id)


def test_using_store_swaps_the_store_only(tmp_path):
    app = AppState()
    with service.using_app(app):
        tab = service.Session()  # held here: the app holds its sessions weakly (Gradio holds them)
        service.track(tab, "kept-hash")
        with store.using_store(KVStore(tmp_path / "drill")) as drill:
            assert store.media_store() is drill
            assert service.open_session("kept-hash") is tab  # the sessions are the app's own
            assert service.current_app().uploads is app.uploads and service.current_app().models is app.models
        assert service.current_app() is app
        service.release("kept-hash")


def _open_store_in_child(answers) -> None:
    opened = store.media_store()
    answers.put(str(opened.root))


def test_a_forked_worker_opens_the_store_anew_and_never_sweeps(tmp_path, monkeypatch):
    """The parent's store is not the worker's (its writer threads are not in the fork); a folder
    that looks abandoned stays, since the worker's parent is alive and sweeps at its own start."""
    monkeypatch.setenv("KV_ARENA_KV_STORE", str(tmp_path / "kv"))
    dead = tmp_path / "kv" / "p1-0123abcd"
    (dead / ("ab" * 16)).mkdir(parents=True)
    (dead / instance.ALIVE).touch()  # its lock file, free: that process is gone
    with service.using_app(AppState()):
        answers = FORK.Queue()
        worker = FORK.Process(target=_open_store_in_child, args=(answers,))
        worker.start()
        root = answers.get(timeout=60)
        worker.join(60)
        assert worker.exitcode == 0 and Path(root).parent == tmp_path / "kv" and dead.exists()
        store.media_store()  # the app's own first opening sweeps what a gone process left
        assert not dead.exists()


def test_the_uploads_ledger_is_the_applications(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    path = tmp_path / "up" / "a.png"
    path.parent.mkdir()
    path.write_bytes(b"not really a png")
    with service.using_app(AppState()):
        uploads.note_uploads([str(path)], "client-a")
        assert not uploads.may_read(str(path), "client-b")
    with service.using_app(AppState()):  # another app never saw that upload: it cannot tell whose it is
        assert not uploads.may_read(str(path), "client-a") and not uploads.may_read(str(path), None)
