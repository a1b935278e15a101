"""MPIC: the media KV store, linking stored KV at any position, and the reuse modes."""

from __future__ import annotations

import json
import math
import struct
import time

import pytest
import torch
from tests.support import make_image, make_video

import backends
from backends.mpic import shift_keys
from kv_arena.mpic.kv_store import KVStore
from kv_arena.mpic.linking import Linker, ingest, media_key
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message

QUESTION = "Which colours dominate these pictures?"


@pytest.fixture
def store(tmp_path):
    return KVStore(tmp_path / "store")


def run(loaded, store, session, message, mode, **params):
    """One prefill (and one token) with the MPIC backend in ``mode``; returns (logits, conversation)."""
    conv = Conversation(loaded, backends.make_backend("mpic", mode=mode, **params), linker=Linker(store, session))
    update = conv.ask(message, max_new_tokens=1)
    return conv.last_logits, conv, update


def moved(*images):
    """The question ahead of the images: the images sit at other positions than when stored."""
    return Message(QUESTION, images=list(images), media_first=False)


# --- linking ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-llava"])
def test_original_position_reproduces_full_recompute(models, store, model):
    loaded, image = models(model), make_image(1)
    ingest(loaded, store, "a", image)
    message = Message(QUESTION, images=[image])  # the image right after the fixed prefix, as stored
    ref, _, ref_update = run(loaded, store, "a", message, "recompute")
    every, conv, update = run(loaded, store, "a", message, "mpic", k=4096)
    assert conv.linker.status == ["linked"]
    assert update.token_ids == ref_update.token_ids
    torch.testing.assert_close(every, ref, atol=1e-5, rtol=0)
    # reusing every image token there is exact too: its stored KV saw the very same prefix
    reused, conv, _ = run(loaded, store, "a", message, "mpic", k=0)
    assert len(conv.backend.report.reused[0]) == conv.layouts[0].visuals[0].length
    torch.testing.assert_close(reused, ref, atol=1e-5, rtol=0)


def test_rerotation_round_trip_and_moved_keys_exact(models, store):
    loaded, image = models("tiny-qwen2-vl"), make_image(1)
    key = ingest(loaded, store, "a", image)
    entry = store.get("a", loaded.spec.name, key)
    conv = Conversation(loaded, backends.make_backend("full"))
    stored = entry.tensor("k.0")
    for delta in (1, 37, -5, 1000):
        back = shift_keys(shift_keys(stored, delta, conv.rotary, 3), -delta, conv.rotary, 3)
        torch.testing.assert_close(back, stored, atol=1e-5, rtol=0)
    # layer-0 keys depend only on the token and its position: the stored ones, moved by the M-RoPE
    # shift of the new prompt, must equal the keys computed there
    conv.ask(moved(image), max_new_tokens=1)
    first, end = conv.layouts[0].visuals[0].span
    stored_rope = entry.tensor("rope")
    delta = int(conv.adapter.encode_turn(moved(image), 0, 0, conv.system_prompt).rope_ids[0, first] - stored_rope[0, 0])
    assert delta > 0
    fresh = conv.cache.layers[0].keys[:, :, first:end]
    torch.testing.assert_close(shift_keys(stored, delta, conv.rotary, 3), fresh, atol=1e-5, rtol=0)


def test_deepstack_features_are_stored_and_added_to_recomputed_tokens(models, store):
    """Qwen3-VL adds DeepStack features to the first decoder layers' hidden states at visual tokens:
    the store keeps them with the embeddings (zero on a video's timestamp text), and every token a
    linked step recomputes gets them, so recomputing all of a moved image and video from the store
    (k covers them) gives the logits of a full recompute; CacheBlend narrows rows at a DeepStack
    layer; prefix caching feeds embeddings after the prefix with their features."""
    loaded, image, video = models("tiny-qwen3-vl"), make_image(1, (224, 224)), make_video(2)
    ingest(loaded, store, "a", image)
    key = ingest(loaded, store, "a", video)
    entry = store.get("a", loaded.spec.name, key)
    features = entry.tensor("deepstack")
    assert features.shape[0] == 3 == len(loaded.model.config.vision_config.deepstack_visual_indexes)
    layout = loaded.adapter.encode_turn(Message(videos=[video]), 0, 0, "x", close_turn=False).layout
    assert len(layout.videos[0].frames) == 2  # two temporal patches, a timestamp before each
    visual = features.abs().sum(dim=(0, 2)) > 0
    assert int(visual.sum()) == layout.videos[0].length < visual.numel()

    message = Message(QUESTION, images=[image], videos=[video], media_first=False)
    ref, _, ref_update = run(loaded, store, "a", message, "recompute")
    every, conv, update = run(loaded, store, "a", message, "mpic", k=4096)
    assert conv.linker.status == ["linked", "linked"] and update.token_ids == ref_update.token_ids
    torch.testing.assert_close(every, ref, atol=1e-5, rtol=0)

    _, conv, _ = run(loaded, store, "a", message, "cacheblend", check_layer=1)
    chunk = conv.layouts[0]
    reused = chunk.length - len(conv.backend.report.recomputed[2])
    assert 0 < reused < sum(v.span[1] - v.span[0] for v in chunk.visuals)

    run(loaded, store, "b", Message("Describe.", images=[image], media_first=False), "prefix")
    ref, _, _ = run(loaded, store, "b", Message("Describe.", images=[image], videos=[video]), "recompute")
    logits, conv, _ = run(loaded, store, "b", Message("Describe.", images=[image], videos=[video]), "prefix")
    assert len(conv.backend.report.reused[0]) > 0
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_modes_recompute_what_the_paper_says(models, store):
    loaded, images = models("tiny-qwen2-vl"), [make_image(1), make_image(2)]
    for image in images:
        ingest(loaded, store, "a", image)
    message = moved(*images)
    _, conv, _ = run(loaded, store, "a", message, "mpic", k=32)
    layout = conv.layouts[0]
    visual = sum(v.length for v in layout.visuals)
    text = layout.length - visual
    assert conv.linker.status == ["linked", "linked"]
    assert [len(r) for r in conv.backend.report.recomputed] == [text + 32 * 2] * 4
    assert [len(r) for r in conv.backend.report.reused] == [visual - 32 * 2] * 4
    assert conv.cache.tokens_per_layer() == [layout.length] * 4  # nothing is evicted

    _, conv, _ = run(loaded, store, "a", message, "full_reuse")
    assert conv.backend.report.steps == 2
    assert len(conv.backend.report.reused[0]) == visual

    _, conv, _ = run(loaded, store, "a", message, "cacheblend", recompute_ratio=0.3)
    counts = [len(r) for r in conv.backend.report.recomputed]
    assert counts[0] == layout.length  # every token before the check layer
    assert counts[1:] == [text + math.ceil(0.3 * visual)] * 3  # text plus 30% of the reused image tokens
    assert len(conv.backend.report.reused[1]) == layout.length - counts[1]


@pytest.mark.parametrize("count", [1, 2, 4])
def test_cacheblend_recomputes_its_share_of_the_reused_tokens_whatever_the_text(models, store, count):
    """CacheBlend-15% recomputes 15% of the *reused* (image) tokens on top of all the text: 39, 77
    and 154 image tokens for 1, 2 and 4 stored 256-token images, even with the text over 15% of the
    prompt (counting the text inside the 15% recomputed no image token for 1 or 2 images)."""
    loaded = models("tiny-qwen2-vl")
    images = [make_image(i) for i in range(count)]
    for image in images:
        ingest(loaded, store, "a", image)
    _, conv, _ = run(loaded, store, "a", moved(*images), "cacheblend")
    layout = conv.layouts[0]
    visual = torch.cat([torch.arange(*v.span) for v in layout.visuals])
    text = layout.length - visual.numel()
    if count == 1:
        assert text > 0.15 * layout.length  # the case that used to recompute no image token
    for recomputed in conv.backend.report.recomputed[1:]:
        assert int(torch.isin(recomputed, visual).sum()) == {1: 39, 2: 77, 4: 154}[count]
        assert len(recomputed) == text + {1: 39, 2: 77, 4: 154}[count]


def test_prefix_caching_reuses_only_the_exact_prefix(models, store):
    loaded, image = models("tiny-qwen2-vl"), make_image(1)
    run(loaded, store, "a", Message("Describe the picture.", images=[image], media_first=False), "prefix")
    ref, _, _ = run(loaded, store, "a", moved(image), "recompute")
    logits, conv, _ = run(loaded, store, "a", moved(image), "prefix")
    reused = len(conv.backend.report.reused[0])
    assert 0 < reused < conv.layouts[0].visuals[0].span[0]  # system prompt and header, not the question
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_without_a_store_it_is_the_full_cache(models, image):
    loaded = models("tiny-qwen2-vl")
    message = Message("Describe it.", images=[image])
    ref = Conversation(loaded, backends.make_backend("full")).ask(message, max_new_tokens=6)
    got = Conversation(loaded, backends.make_backend("mpic")).ask(message, max_new_tokens=6)
    assert got.token_ids == ref.token_ids


def test_second_turn_links_and_decodes(models, store):
    loaded, images = models("tiny-qwen2-vl"), [make_image(1), make_image(2)]
    ingest(loaded, store, "a", images[1])
    conv = Conversation(loaded, backends.make_backend("mpic"), linker=Linker(store, "a"))
    conv.ask(Message("Hello."), max_new_tokens=3)
    update = conv.ask(Message("And this one?", images=[images[1]]), max_new_tokens=4)
    assert conv.linker.status == ["linked"]
    assert len(update.token_ids) >= 1 and conv.cache.tokens_per_layer()[0] == conv.seen


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError):
        backends.make_backend("mpic", mode="everything")
    with pytest.raises(ValueError):
        backends.make_backend("mpic", k=-1)


# --- the store --------------------------------------------------------------------------------


def test_another_session_cannot_link_an_entry(models, store):
    loaded, image = models("tiny-qwen2-vl"), make_image(1)
    key = ingest(loaded, store, "alice", image)
    store.flush()
    name = loaded.spec.name
    assert store.get("alice", name, key) is not None
    assert store.get("bob", name, key) is None  # same content hash, other namespace
    alice_file = store.path("alice", name, key)
    for forged in (str(alice_file), f"../{alice_file.parent.parent.name}/{key}", key.upper(), key[:-1] + "/"):
        with pytest.raises(ValueError):
            store.get("bob", name, forged)
    assert store.path("../alice", name, key).parent.parent.parent == store.root  # session ids never form paths
    _, conv, _ = run(loaded, store, "bob", moved(image), "mpic")
    assert conv.linker.status == ["recomputed (not stored)"]
    assert store.library("bob") == [] and len(store.library("alice")) == 1


def test_damaged_files_fall_back_to_recompute(models, tmp_path):
    loaded, image = models("tiny-qwen2-vl"), make_image(1)
    root = tmp_path / "store"
    writer = KVStore(root)
    key = ingest(loaded, writer, "a", image)
    writer.flush()
    path = writer.path("a", loaded.spec.name, key)
    data = path.read_bytes()
    ref, _, _ = run(loaded, KVStore(tmp_path / "empty"), "a", moved(image), "recompute")

    from_disk = KVStore(root)  # a restart: the memory tier is empty, the file is read in the background
    linked, conv, _ = run(loaded, from_disk, "a", moved(image), "mpic")
    assert conv.linker.status == ["linked"]

    path.write_bytes(data[: len(data) // 2])  # truncated
    logits, conv, _ = run(loaded, KVStore(root), "a", moved(image), "mpic")
    assert conv.linker.status == ["recomputed (not stored)"] and not path.exists()
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)

    path.write_bytes(flip_byte(data, "k.2"))  # same size, one bad byte in layer 2: found mid-forward by its checksum
    logits, conv, _ = run(loaded, KVStore(root), "a", moved(image), "mpic")
    assert conv.linker.status == ["recomputed (damaged file)"] and not path.exists()
    assert conv.cache.tokens_per_layer() == [conv.seen] * 4
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def flip_byte(data: bytes, tensor: str) -> bytes:
    """The safetensors file ``data`` with one byte of ``tensor`` inverted."""
    (length,) = struct.unpack("<Q", data[:8])
    first, _ = json.loads(data[8:8 + length])[tensor]["data_offsets"]
    damaged = bytearray(data)
    damaged[8 + length + first + 5] ^= 0xFF
    return bytes(damaged)


def test_store_respects_caps_and_expiry(tmp_path):
    def tensors(seed):
        return {"k.0": torch.randn(1, 2, 100, 32, generator=torch.Generator().manual_seed(seed))}  # 25.6 kB

    keys = [f"{i:064x}" for i in range(4)]
    store = KVStore(tmp_path, memory_bytes=60_000, disk_bytes=60_000)
    for i, key in enumerate(keys[:2]):
        store.put("s", "m", key, tensors(i), {"kind": "image"})
    store.flush()
    time.sleep(0.01)
    store.get("s", "m", keys[0])  # used: the second entry is now the least recent, in memory and on disk
    store.put("s", "m", keys[2], tensors(2), {"kind": "image"})
    store.flush()
    assert store.memory_nbytes() <= 60_000 and store.disk_nbytes() <= 60_000
    assert len(store.library("s")) == 2  # two 25.6 kB entries fit, three do not
    assert store.get("s", "m", keys[0]) is not None and store.get("s", "m", keys[2]) is not None
    torch.testing.assert_close(KVStore(tmp_path).get("s", "m", keys[2]).tensor("k.0"), tensors(2)["k.0"])

    expiring = KVStore(tmp_path / "ttl", ttl_s=0.0)
    expiring.put("s", "m", keys[3], tensors(3), {"kind": "image"})
    expiring.flush()
    assert expiring.get("s", "m", keys[3]) is None and expiring.library("s") == []


def test_content_key_ignores_the_file_name(tmp_path):
    image = make_image(3)
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    image.save(a)
    image.save(b)
    from kv_arena.media import load_image

    assert media_key(load_image(str(a))) == media_key(load_image(str(b))) == media_key(image)
    assert media_key(make_image(4)) != media_key(image)
