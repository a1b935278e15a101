"""MPIC's media KV on a shared Valkey/Redis server (issue #41), against a real server each test
module starts itself (skipped only where no ``valkey-server`` or ``redis-server`` is installed):
entries round-trip per tenant with their checks, a damaged, foreign, malformed or misplaced entry is
a miss and goes, a load that fails or never comes never holds a turn, the server's own expiry and
memory cap, every fault degrading to the local store, two app processes on one server, and a server
killed mid-turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from tests.app_support import MODEL, ask, turn
from tests.support import make_image

import backends
from kv_arena import service
from kv_arena.media import load_image
from kv_arena.bench.valkey_server import LocalServer, free_port, server_binary
from kv_arena.mpic.kv_store import CorruptEntry, KVStore
from kv_arena.mpic.linking import Linker, ingest, media_key
from kv_arena.mpic.server_store import META, PUBLIC_SALT, ServerStore
from kv_arena.mpic.store_api import MediaStore
from kv_arena.mpic.ttft import time_prompt
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.service import store as service_store

pytestmark = pytest.mark.skipif(server_binary() is None, reason="no valkey-server or redis-server installed "
                                "(apt-get install redis-server; .ci/run installs it)")
ROOT = Path(__file__).resolve().parents[1]
KEYS = [f"{i:064x}" for i in range(4)]


@pytest.fixture(scope="module")
def server():
    with LocalServer() as running:
        yield running


@pytest.fixture
def fresh(server, tmp_path):
    """A store as a new replica has it: an empty local tier, the shared server behind it."""
    server.client().flushall()
    made = []

    def make(url=None, **kw):
        store = ServerStore(url or server.url, KVStore(tmp_path / f"local{len(made)}"), retry_s=0.0, **kw)
        made.append(store)
        return store
    yield make
    for store in made:
        store.flush()


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embeds": torch.randn(6, 8, generator=g).to(torch.bfloat16), "rope": torch.arange(18).reshape(3, 6),
            "k.0": torch.randn(1, 2, 6, 4, generator=g), "v.0": torch.randn(1, 2, 6, 4, generator=g)}


def test_an_entry_round_trips_through_the_server_to_its_tenant_only(fresh):
    writer, reader = fresh(), fresh()
    assert isinstance(writer, MediaStore) and isinstance(KVStore("/nonexistent"), MediaStore)
    writer.put("alice", "m", KEYS[0], tensors(), {"kind": "image", "tokens": 6, "label": "a.png"})
    writer.flush()
    entry = reader.get("alice", "m", KEYS[0])  # nothing local: from the server, in the background
    for name, value in tensors().items():
        got = entry.tensor(name)
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value)
    assert reader.get("bob", "m", KEYS[0]) is None  # another tenant, by the same content hash
    assert reader.get("alice", "other-model", KEYS[0]) is None
    rows = reader.library("alice")
    assert [(r["label"], r["on_server"]) for r in rows] == [("a.png", True)] and reader.library("bob") == []
    assert reader.health_note() == ""
    deadline = time.monotonic() + 5
    while reader.local.get("alice", "m", KEYS[0]) is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the loaded entry joins the memory tier in front
    assert reader.local.get("alice", "m", KEYS[0]) is not None


def test_a_damaged_or_foreign_entry_is_a_miss_and_goes(server, fresh):
    writer = fresh()
    for key in KEYS[:3]:
        writer.put("alice", "m", key, tensors(), {"kind": "image"})
    writer.flush()
    raw = server.client()
    damaged, foreign, typed = (writer.name(writer.salt("alice"), "m", key) for key in KEYS[:3])
    value = bytearray(raw.hget(damaged, "k.0"))
    value[5] ^= 0xFF  # same size: only the checksum can tell
    raw.hset(damaged, "k.0", bytes(value))
    meta = json.loads(raw.hget(foreign, META))
    raw.hset(foreign, META, json.dumps(dict(meta, format=99)))  # another version's (or anyone's) entry
    raw.delete(typed)
    raw.set(typed, b"not a hash")
    reader = fresh()
    entry = reader.get("alice", "m", KEYS[0])
    with pytest.raises(CorruptEntry):
        entry.tensor("v.0")
    assert reader.get("alice", "m", KEYS[1]) is None and reader.get("alice", "m", KEYS[2]) is None
    time.sleep(0.2)
    assert not any(raw.exists(n) for n in (damaged, foreign, typed))  # recomputed and stored anew, never read
    with pytest.raises(ValueError):
        reader.get("alice", "m", "../../etc")


def test_expiry_and_the_memory_cap_are_the_servers(fresh, tmp_path):
    store = fresh(ttl_s=120)
    store.put("alice", "m", KEYS[0], tensors(), {"kind": "image"})
    store.flush()
    name = store.name(store.salt("alice"), "m", KEYS[0])
    assert 0 < store.server.ttl(name) <= 120
    with LocalServer(["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as small:
        full = fresh(small.url)
        big = {"k.0": torch.randn(1, 2, 4096, 128)}  # 4 MB: past the cap
        full.put("alice", "m", KEYS[1], big, {"kind": "image"})
        full.flush()
        assert "full" in full.health_note()
        assert torch.equal(full.get("alice", "m", KEYS[1]).tensor("k.0"), big["k.0"])  # the local tier holds it


def test_a_server_down_at_start_or_slow_degrades_to_the_local_store(server, fresh):
    down = fresh(f"redis://127.0.0.1:{free_port()}/0")
    assert "unavailable" in down.health_note()
    down.put("alice", "m", KEYS[0], tensors(), {"kind": "image"})
    assert down.get("alice", "m", KEYS[0]) is not None  # the local store serves
    slow = fresh(timeout_s=0.2)
    pauser = server.client()
    pauser.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    try:
        started = time.monotonic()
        assert slow.get("alice", "m", KEYS[1]) is None  # one timeout, then a miss (recomputed)
        assert time.monotonic() - started < 1.0 and "unavailable (TimeoutError)" in slow.health_note()
    finally:
        pauser.execute_command("CLIENT", "UNPAUSE")
    slow.put("alice", "m", KEYS[1], tensors(), {"kind": "image"})  # back (retry_s=0): written again
    slow.flush()
    assert slow.health_note() == "" and fresh().get("alice", "m", KEYS[1]) is not None


def test_public_examples_are_shared_across_tenants_only_when_enabled(fresh):
    public = media_key(make_image(9))
    writer = fresh(public_keys={public})
    writer.put("alice", "m", public, tensors(), {"kind": "image"})
    writer.put("alice", "m", KEYS[0], tensors(), {"kind": "image"})
    writer.flush()
    assert writer.server.exists(writer.name(PUBLIC_SALT, "m", public))
    assert fresh(public_keys={public}).get("bob", "m", public) is not None
    assert fresh(public_keys={public}).get("bob", "m", KEYS[0]) is None  # only the named content is public
    assert fresh().get("bob", "m", public) is None  # not shared by a replica that does not opt in


def outcome(store, session: str, key: str, within: float = 10.0) -> str:
    """What a turn gets from looking ``key`` up and reading every tensor: "miss", "damaged" (the
    linker recomputes) or "used"; "stuck" if that did not end within ``within`` s."""
    got = []

    def look():
        entry = store.get(session, "m", key)
        try:
            got.append("miss" if entry is None else [entry.tensor(n) for n in entry.names] and "used")
        except CorruptEntry:
            got.append("damaged")
    reading = threading.Thread(target=look, daemon=True)  # a stuck one must not hold the test run
    reading.start()
    reading.join(within)
    return got[0] if got else "stuck"


def gone(raw, name: str, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while raw.exists(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not raw.exists(name)


MALFORMED = {  # the metadata of a stored entry, edited on the server; each breaks one rule
    "float dims, same product": lambda m: m["shape"].update(embeds=[2.0, 3.0, 8]),
    "negative dims, same product": lambda m: m["shape"].update(embeds=[-6, -8]),
    "bool dims": lambda m: m["shape"].update(rope=[3, True, 6]),
    "too many dims": lambda m: m["shape"].update(rope=[1] * 20 + [3, 6]),
    "unknown dtype": lambda m: m["dtype"].update(embeds="complex64"),
    "dtype not a string": lambda m: m["dtype"].update(embeds=["bfloat16"]),
    "checksum a float": lambda m: m["crc"].update(embeds=float(m["crc"]["embeds"])),
    "byte count a float": lambda m: m.update(bytes=float(m["bytes"])),
    "a tensor without a shape": lambda m: m["shape"].pop("k.0"),
    "names repeated": lambda m: m.update(names=m["names"] + m["names"][:1]),
    "created as text": lambda m: m.update(created="yesterday"),
    "a token prefix's kind": lambda m: m.update(kind="prefix"),
}


@pytest.mark.parametrize("edit", list(MALFORMED), ids=list(MALFORMED))
def test_a_malformed_entry_is_a_miss_and_goes_and_the_next_request_is_served(server, fresh, edit):
    writer = fresh()
    for key in KEYS[:2]:
        writer.put("alice", "m", key, tensors(), {"kind": "image", "tokens": 6, "label": "a.png"})
    writer.flush()
    raw = server.client()
    name = writer.name(writer.salt("alice"), "m", KEYS[0])
    meta = json.loads(raw.hget(name, META))
    MALFORMED[edit](meta)
    raw.hset(name, META, json.dumps(meta))
    reader = fresh()
    assert outcome(reader, "alice", KEYS[0]) == "miss"  # recomputed: never a loader left to fail
    assert gone(raw, name)
    assert outcome(reader, "alice", KEYS[1]) == "used"  # the same replica serves the next request
    assert [row["label"] for row in reader.library("alice")] == ["a.png"]


def test_a_loader_that_fails_fails_the_load_and_the_entry_goes(server, fresh, monkeypatch, caplog):
    writer = fresh()
    for key in KEYS[:2]:
        writer.put("alice", "m", key, tensors(), {"kind": "image"})
    writer.flush()
    from kv_arena.mpic import server_store

    def fails_once(data, meta, field, _read=server_store.read_tensor, _failed=[]):
        if field == "k.0" and not _failed:
            _failed.append(field)
            raise RuntimeError("a loader's own fault")  # not a check that failed: anything a thread can raise
        return _read(data, meta, field)
    monkeypatch.setattr(server_store, "read_tensor", fails_once)
    reader = fresh()
    caplog.set_level("WARNING", logger="kv_arena.mpic.server_store")
    assert outcome(reader, "alice", KEYS[0]) == "damaged"  # the waiting turn recomputes
    assert gone(reader.server, reader.name(reader.salt("alice"), "m", KEYS[0]))
    assert [r.getMessage() for r in caplog.records if "could not be loaded" in r.getMessage()] == [
        f"shared media store {server.url}: entry {KEYS[0][:12]} could not be loaded "
        "(RuntimeError: a loader's own fault): deleted, recomputed"]
    assert outcome(reader, "alice", KEYS[1]) == "used"


def test_a_load_that_never_comes_times_out_into_a_miss(server, fresh, tmp_path):
    writer = fresh()
    writer.put("alice", "m", KEYS[0], tensors(), {"kind": "image"})
    writer.flush()
    stuck = ServerStore(server.url, KVStore(tmp_path / "stuck", load_timeout_s=0.5))
    release = threading.Event()
    stuck.hold_loads(release)  # every loader busy: a load that never starts
    try:
        started = time.monotonic()
        assert outcome(stuck, "alice", KEYS[0]) == "damaged"  # LoadTimeout: the turn recomputes
        assert time.monotonic() - started < 3
        assert outcome(stuck, "alice", KEYS[0]) == "damaged"  # and the next turn too, as long as it lasts
    finally:
        release.set()
    assert outcome(stuck, "alice", KEYS[0]) == "used"  # the loaders back: the entry, kept, serves


def test_an_entry_copied_under_another_name_is_not_used_and_goes(server, fresh):
    """A red picture's KV, checksums valid, under the blue picture's name or another tenant's."""
    writer = fresh()
    red, blue = KEYS[:2]
    writer.put("alice", "m", red, tensors(1), {"kind": "image"})
    writer.flush()
    raw = server.client()
    fields = {k.decode(): v for k, v in raw.hgetall(writer.name(writer.salt("alice"), "m", red)).items()}
    blues = writer.name(writer.salt("alice"), "m", blue)  # the name and key in it made the blue one's
    raw.hset(blues, mapping=dict(fields, meta=json.dumps(dict(json.loads(fields[META]), key=blue, name=blues))))
    bobs = writer.name(writer.salt("bob"), "m", red)
    raw.hset(bobs, mapping=fields)  # alice's entry, byte for byte, in bob's name
    reader = fresh()
    assert outcome(reader, "alice", blue) in ("miss", "damaged")  # recomputed: never the red KV
    assert outcome(reader, "bob", red) == "miss"
    assert gone(raw, blues) and gone(raw, bobs)
    assert outcome(reader, "alice", red) == "used"  # the entry in its own name still serves


# --- with the model -------------------------------------------------------------------------


FIRST_APP = textwrap.dedent("""
    from kv_arena import service
    from kv_arena.service.store import media_store
    from tests.app_support import ask, turn
    session = service.Session()
    service.track(session, None, "alice")  # the browser's cookie: the same on every replica
    _, error = turn(session, ask("Stored.", {image!r}), method="mpic", params={{"mpic": {{"k": 4}}}})
    assert error is None, error
    media_store().flush()
    print([row.on_server for row in service.media_library(session)])
""")


@pytest.fixture(scope="module")
def stored_by_another_process(server, media, tmp_path_factory):
    """A first app process, its own local store, stored the image on the server for client alice."""
    server.client().flushall()
    env = dict(os.environ, KV_ARENA_KV_STORE_URL=server.url, KV_ARENA_KV_STORE=str(tmp_path_factory.mktemp("first")))
    done = subprocess.run([sys.executable, "-c", FIRST_APP.format(image=media["image"])],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[True]"
    return media["image"]


@pytest.fixture
def app_store(server, tmp_path, monkeypatch):
    """This process as the second replica: the app's store from the environment, as it makes it."""
    monkeypatch.setenv("KV_ARENA_KV_STORE_URL", server.url)
    monkeypatch.setenv("KV_ARENA_KV_STORE", str(tmp_path / "second"))
    with service_store.using_store(service_store.make_store()) as store:
        yield store


def test_a_second_app_process_links_what_the_first_stored_without_the_vision_tower(
        stored_by_another_process, app_store, models):
    loaded = models(MODEL)
    message = Message("Which colour?", images=[make_image(1, (112, 112))], media_first=False)
    assert media_key(message.images[0]) == media_key(load_image(stored_by_another_process))
    service_store.bind_tenant("tab-of-alice", "alice")  # another tab of alice's browser, on this replica
    mpic = time_prompt(loaded, app_store, "tab-of-alice", message, "mpic", k=4)
    assert mpic["status"] == ["linked"] and mpic["vision_s"] == 0
    service_store.bind_tenant("tab-of-bob", "bob")
    other = time_prompt(loaded, app_store, "tab-of-bob", message, "mpic", k=4)
    assert other["status"] == ["recomputed (not stored)"] and other["vision_s"] > 0
    # the same in the app: alice's next tab reuses it, bob's sees and links nothing of hers
    alice, bob = service.Session(), service.Session()
    service.track(alice, None, "alice")
    service.track(bob, None, "bob")
    assert [r.on_server for r in service.media_library(alice)] == []  # no model used yet in this tab
    outputs, error = turn(alice, ask("Again?", stored_by_another_process), method="mpic", params={"mpic": {"k": 4}})
    assert error is None and "reused from the media store" in outputs[-1].status
    assert "recomputed (" not in outputs[-1].status and "shared media store" not in outputs[-1].status
    assert service.media_library(bob) == []
    for tab in (alice, bob):
        tab.close()
        service_store.bind_tenant(tab.id, None)


def answered_within(seconds: float, image: str) -> str:
    """The MPIC status line of a turn of client alice's new tab, which must end within ``seconds``
    (a turn that waits for ever holds the replica's one processing slot)."""
    tab, done = service.Session(), {}
    service.track(tab, None, "alice")
    answering = threading.Thread(target=lambda: done.update(zip(("outputs", "error"), turn(
        tab, ask("Which colour?", image), method="mpic", params={"mpic": {"k": 4}}))), daemon=True)
    answering.start()
    answering.join(seconds)
    assert done, f"the turn did not end within {seconds} s"
    assert done["error"] is None, done["error"]
    tab.close()
    service_store.bind_tenant(tab.id, None)
    return done["outputs"][-1].status


def test_a_turn_never_waits_on_a_malformed_entry_or_a_stuck_load(server, media, models, tmp_path, monkeypatch):
    models(MODEL)
    server.client().flushall()
    monkeypatch.setenv("KV_ARENA_KV_STORE_URL", server.url)
    monkeypatch.setenv("KV_ARENA_KV_STORE_LOAD_TIMEOUT_S", "1")

    def replica(folder: str):  # a new app process: an empty local tier, the shared server behind it
        monkeypatch.setenv("KV_ARENA_KV_STORE", str(tmp_path / folder))
        return service_store.using_store(service_store.make_store())
    with replica("first") as first:
        answered_within(120, media["image"])
        first.flush()
    raw = server.client()
    (name,) = raw.keys("kv-arena:mpic:*")
    meta = json.loads(raw.hget(name, META))
    rows, cols = meta["shape"]["embeds"]
    meta["shape"]["embeds"] = [2.0, -rows / 2, -cols]  # the same product
    raw.hset(name, META, json.dumps(meta))
    with replica("second") as second:
        assert "recomputed (" not in answered_within(60, media["image"])  # a miss: stored anew, then linked
        second.flush()
        shapes = json.loads(raw.hget(name, META))["shape"].values()
        assert all(type(d) is int and d >= 0 for shape in shapes for d in shape)  # the malformed one went
    with replica("third") as third:
        release = threading.Event()
        third.hold_loads(release)  # every load stuck before it starts
        try:
            for _ in range(2):  # the turn, and the next request on this process
                status = answered_within(60, media["image"])
                assert "image/video 1 recomputed (stored entry not loaded within 1 s)" in status
        finally:
            release.set()
        status = answered_within(60, media["image"])
        assert "reused from the media store" in status and "recomputed (" not in status


def test_a_server_killed_mid_turn_leaves_the_answer_correct(models, tmp_path, media):
    loaded, image = models(MODEL), make_image(1, (112, 112))
    message = Message("Which colour?", images=[image], media_first=False)
    reference = Conversation(loaded, backends.make_reference()).ask(message, max_new_tokens=3)
    with LocalServer() as doomed:
        first = ServerStore(doomed.url, KVStore(tmp_path / "first"))
        ingest(loaded, first, "alice", image)
        first.flush()
        store = ServerStore(doomed.url, KVStore(tmp_path / "second"), retry_s=60)
        release = threading.Event()
        store.hold_loads(release)  # the kill lands between lookup and load
        done = {}
        conv = Conversation(loaded, backends.make_backend("mpic", k=4), linker=Linker(store, "alice"))
        answering = threading.Thread(target=lambda: done.update(update=conv.ask(message, max_new_tokens=3)))
        answering.start()
        watcher = doomed.client()
        while not watcher.info("commandstats").get("cmdstat_hget"):  # the entry was found on the server
            time.sleep(0.005)
        doomed.kill()
        release.set()
        answering.join(120)
    assert conv.linker.status[0].startswith("recomputed")
    assert done["update"].token_ids == reference.token_ids  # computed as without a cache
    assert "unavailable" in store.health_note()
    # the app says it in one line and answers
    app_side = ServerStore(doomed.url, KVStore(tmp_path / "app"))
    with service_store.using_store(app_side):
        outputs, error = turn(service.Session(), ask("Still?", media["image"]), method="mpic")
    assert error is None and "the shared media store is unavailable (ConnectionError)" in outputs[-1].status


def test_the_mpic_bench_times_images_stored_on_the_server_by_another_process(server, capsys):
    from kv_arena.bench import cli

    code = cli.main(["--mode", "mpic", "--model", "tiny-qwen2-vl", "--counts", "1", "--k", "4", "--image-size", "224",
                     "--repeats", "2", "--vision-layers", "1", "--store-url", server.url, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    (row,) = json.loads(out.out)
    assert row["server_linked"] == ["linked"] and row["parts"]["server"]["vision_s"] == 0
    low, high = row["server_ratio_range"]
    assert low <= row["server_ratio"] <= high
    assert row["parts"]["server"]["new_kv_tokens"] == row["parts"]["mpic"]["new_kv_tokens"]
    assert row["server_same_first_token"] == row["mpic_same_first_token"]  # the same KV as this process's own
