"""MPIC in the app: uploads stored per session and reused in the next turn, no session linking
another's media, a damaged store file, and k suited to the model."""

from __future__ import annotations

import re
from contextlib import ExitStack

import pytest
from tests.app_support import MODEL, ask, turn

from components import chat, media_library, overlay
from kv_arena import service
from kv_arena.mpic.kv_store import KVStore
from kv_arena.service import store as service_store


@pytest.fixture
def media_store(tmp_path):
    """A store of this test's own (the app keeps one per process)."""
    with ExitStack() as stores:
        yield lambda **caps: stores.enter_context(service_store.using_store(KVStore(tmp_path / "kv", **caps)))


def test_mpic_stores_uploads_and_reuses_them_in_the_next_turn(media, media_store):
    media_store()
    session = service.Session()
    k4 = {"mpic": {"k": 4}}  # a 112 px image is 16 tokens: MPIC-4 recomputes 4 of them and links the other 12
    first, error = turn(session, ask("Two pictures.", media["image"], media["image2"]), method="mpic", params=k4)
    assert error is None
    rows = media_library.library_rows(session)
    assert [r[0] for r in rows] == ["a.png", "b.png"] and all(r[1] == "image" and r[3] > 0 for r in rows)
    assert all(r[2] > 0 and r[4] == "yes" for r in rows)
    second, error = turn(session, ask("Which one is brighter?", media["image"], media["image2"]), first[-1].chatbot,
                         method="mpic", params=k4)
    assert error is None and not any(m.get("metadata") for m in second[-1].chatbot)  # the same conversation
    status = second[-1].status
    reused = int(re.search(r"(\d+) prompt tokens reused from the media store", status).group(1))
    assert reused > 0 and "recomputed (" not in status
    assert len(media_library.library_rows(session)) == 2  # stored once, found again
    gallery = second[-1].gallery
    assert len(gallery) == 4 and all("reused" in caption for caption in overlay.captions(session.visuals))
    panels = media_library.refresh(session)
    table, figure = panels.library, panels.ttft
    assert len(table) == 2 and list(figure.data[0].x) == ["Full recompute", "Prefix caching", "MPIC-4"]
    assert all(t > 0 for t in figure.data[0].y)
    # the follow-up of a turn with another method lists the library and leaves the TTFT panel alone
    after = media_library.after_turn(session, "streamingllm")
    assert after.library == table and set(after.changed()) == {"library"}


def test_a_second_session_cannot_see_or_link_the_first_sessions_media(media, media_store):
    store = media_store()
    a, b = service.Session(), service.Session()
    turn(a, ask("Mine.", media["image"]), method="mpic")
    key = service.media_library(a)[0].key
    assert service.media_library(b) == [] and media_library.library_rows(b) == []
    assert store.get(b.id, MODEL, key) is None  # by content hash, from the other namespace
    _, error = turn(b, ask("Theirs?"), method="mpic")
    assert error is None and service.media_library(b) == []
    assert a.id != b.id and service.Session().id not in (a.id, b.id)  # made by the server, per tab
    a.use_model("another-model")  # entries of the previous model go when the model changes
    assert service.media_library(a) == []
    turn(a, ask("Again.", media["image"]), method="mpic")
    store.flush()
    assert (store.root / store.namespace(a.id)).is_dir()
    service.track(a, "tab-mpic")
    service.release("tab-mpic")  # and when the tab closes
    assert store.library(a.id) == []
    assert not (store.root / store.namespace(a.id)).exists()  # its folder too: none left per closed tab


def test_a_damaged_store_file_does_not_break_a_turn(media, media_store):
    store = media_store(memory_bytes=0)  # disk only, so the next turn reads the files
    session = service.Session()
    first, error = turn(session, ask("Stored.", media["image"]), method="mpic")
    assert error is None
    store.flush()
    files = list((store.root).glob("**/*.safetensors"))
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[-64:] = bytes(64)  # same size, so only the checksums can tell
    files[0].write_bytes(bytes(data))
    outputs, error = turn(session, ask("Still there?", media["image"]), first[-1].chatbot, method="mpic")
    assert error is None and outputs[-1].chatbot[-1]["content"]
    # the damaged file is found (by the upload's lookup or by the linker), deleted and recomputed
    assert re.search(r"image/video 1 recomputed \((damaged file|stored entry unusable|not stored)\)", outputs[-1].status)


def test_mpic_default_k_suits_the_model_image_size(media_store):
    assert service.mpic_default_k(MODEL) == 32  # 256 tokens for 448 px: the paper's 32
    assert service.mpic_default_k("tiny-arena-vl") == 32
    # the trained model reuses all but k of a stored scene's 744 tokens (31 x 24 cells) when it is sent again
    media_store()
    session = service.Session()
    scene = str(chat.ASSETS / "scene_colour.png")
    k = {"mpic": {"k": service.mpic_default_k("tiny-arena-vl")}}
    first, _ = turn(session, ask("What colour is the circle?", scene), method="mpic", model="tiny-arena-vl", params=k)
    second, error = turn(session, ask("What colour is the triangle?", scene), first[-1].chatbot, method="mpic",
                         model="tiny-arena-vl", params=k)
    assert error is None
    assert int(re.search(r"(\d+) prompt tokens reused", second[-1].status).group(1)) >= 744 - 32
