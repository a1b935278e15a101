"""The app's GPU work under a stand-in for ZeroGPU's ``spaces.GPU``: every call forks a FRESH
worker (multiprocessing, fork), its arguments go in pickled through a queue, its results (each
yield of a generator) come out pickled through a queue, and nothing it changes in Python objects
reaches the app's process (as in ``spaces/zero/wrappers.py`` of the ``spaces`` package 0.51.3).

A chat must still continue its compressed cache from turn to turn (every method), MPIC's stored
media must reach the app's store, and a comparison must keep its full-cache reference. What
crosses is the state's own data: its caches, their token bookkeeping and the messages' media,
never a module or the model."""

from __future__ import annotations

import inspect
import io
import multiprocessing
import pickle
import queue
import time
import types
from pathlib import Path

import pytest
import torch
from tests.support import make_image

import backends
from kv_arena import service
from kv_arena.runtime.generate import Conversation, ConversationState
from kv_arena.runtime.models import LoadedModel
from kv_arena.service import zerogpu

MODEL = "tiny-qwen2-vl"
FORK = multiprocessing.get_context("fork")
CALL_SECONDS = 300  # a worker that hangs fails its test instead of holding the suite forever


def _worker(fn, args_queue, results_queue) -> None:
    """The forked worker: arguments in, every result (or the error) out, all pickled."""
    args, kwargs = pickle.loads(args_queue.get())
    try:
        result = fn(*args, **kwargs)
        if inspect.isgenerator(result):
            for item in result:
                results_queue.put(("yield", pickle.dumps(item)))
            result = None
        results_queue.put(("return", pickle.dumps(result)))
    except Exception as exc:  # noqa: BLE001 - it crosses back, as ZeroGPU's does
        results_queue.put(("error", pickle.dumps(exc)))


class StandIn:
    """``spaces.GPU`` as ZeroGPU runs it; records each call's requested duration and the workers' pids."""

    def __init__(self) -> None:
        self.seconds: list[int] = []
        self.pids: list[int] = []

    def __call__(self, fn, duration):
        def results(args, kwargs):
            self.seconds.append(duration(*args, **kwargs))
            args_queue, results_queue = FORK.SimpleQueue(), FORK.Queue()
            worker = FORK.Process(target=_worker, args=(fn, args_queue, results_queue), daemon=True)
            worker.start()
            self.pids.append(worker.pid)
            args_queue.put(pickle.dumps((args, kwargs)))
            deadline = time.monotonic() + CALL_SECONDS
            try:
                while True:
                    try:
                        kind, payload = results_queue.get(timeout=1.0)
                    except queue.Empty:
                        if not worker.is_alive():
                            raise RuntimeError(f"the worker died (exit code {worker.exitcode})") from None
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"the worker gave nothing for {CALL_SECONDS} s") from None
                        continue
                    yield kind, pickle.loads(payload)
                    if kind != "yield":
                        return
            finally:
                worker.join(timeout=60)
                if worker.is_alive():
                    worker.kill()

        def stream(*args, **kwargs):
            for kind, value in results(args, kwargs):
                if kind == "error":
                    raise value
                if kind == "yield":
                    yield value

        def call(*args, **kwargs):
            for kind, value in results(args, kwargs):
                if kind == "error":
                    raise value
                return value
        return stream if inspect.isgeneratorfunction(fn) else call


@pytest.fixture
def zero_gpu(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(zerogpu, "ZERO_GPU", True)  # states cross on the CPU, as on a Space
    previous = zerogpu.use_decorator(stand_in)
    yield stand_in
    zerogpu.use_decorator(previous)


@pytest.fixture
def picture(tmp_path):
    path = tmp_path / "board.png"
    make_image(3, (112, 112)).save(path)
    return str(path)


def settings(method: str, **kw) -> service.Settings:
    return service.Settings.make(model=model_for(method), method=method, budget=0.5, max_new_tokens=6, **kw)


def model_for(method: str) -> str:
    """MODEL, or the tiny LLaVA for a method that reads a CLS token in the vision tower (VisionZip),
    which MODEL's tower has not."""
    return "tiny-llava" if backends.make_backend(method).selects_visual_tokens else MODEL


def chat(session, settings_, text, *files):
    views = list(service.chat_turn(session, settings_, service.prepare(text, list(files))))
    return views[-1]


def test_two_turns_continue_the_compressed_cache_across_fresh_workers(zero_gpu, picture):
    config = settings("streamingllm")
    session = service.Session()
    first = chat(session, config, "What is in the picture?", picture)
    after_first = session.conv.cache.tokens_per_layer()
    kept = [layer.keys.clone() for layer in session.conv.cache.layers]
    assert isinstance(session.conv, ConversationState)  # came back from the worker without the model
    assert all(t.device.type == "cpu" for t in kept)

    second = chat(session, config, "And what colour is it?")
    assert not second.new_chat and len(session.history) == 2
    after_second = session.conv.cache.tokens_per_layer()
    assert all(b > a for a, b in zip(after_first, after_second))  # the cache grew: the first turn is in it
    for before, layer in zip(kept, session.conv.cache.layers):  # StreamingLLM's sinks stay as they were
        assert torch.equal(layer.keys[..., :2, :], before[..., :2, :])
    assert len(set(zero_gpu.pids)) == len(zero_gpu.pids) >= 2  # a fresh worker on every call

    # the same two turns in this process give the same tokens
    loaded = service.get_model(MODEL)
    conv = Conversation(loaded, service.plan_turn(config).backend)
    plain = [conv.ask(p.message, max_new_tokens=6).text for p in session.history]
    assert [first.text, second.text] == plain
    assert first.reference is not None and second.agreement is not None


class StrictPickler(pickle.Pickler):
    """A pickler that refuses what a chat state must never carry (a module, the loaded model, a
    method bound to an object, such as a Conversation's, which would bring its model along) and
    counts the tensors it writes."""

    def __init__(self, file) -> None:
        super().__init__(file)
        self.tensors = 0

    def reducer_override(self, obj):
        if isinstance(obj, (torch.nn.Module, LoadedModel)) or (
                isinstance(obj, types.MethodType) and not isinstance(obj.__self__, type)):
            raise AssertionError(f"the state pickles {type(obj).__name__}: {obj!r:.120}")
        self.tensors += isinstance(obj, torch.Tensor)
        return NotImplemented


PER_TENSOR = 512  # what torch's pickling adds to each tensor (its storage record, shape, dtype)
SMALL = 16 * 1024  # the rest: layouts, token ids, the last logits, the references' figures, the reports' scalars


def allowance(state: service.ChatState, tensors: int) -> int:
    """What a state may pickle to: its caches' bytes (``KVCache.nbytes``, both the chat's and the
    full-cache reference's) with one int64 token index per held entry, its messages' pixels, and a
    small constant."""
    convs = [c for c in (state.conv, state.references.conv) if c is not None]
    caches = sum(c.cache.nbytes() + 8 * sum(p.numel() for p in c.cache.kept_positions()) for c in convs)
    media = sum(image.width * image.height * 3 for p in state.history for image in p.message.images)
    media += sum(video.frames.nbytes for p in state.history for video in p.message.videos)
    return caches + media + PER_TENSOR * tensors + SMALL


@pytest.mark.parametrize("method", backends.available())
def test_every_method_continues_its_chat_across_fresh_workers_and_sends_only_its_data(zero_gpu, picture, method):
    session, config = service.Session(), settings(method)
    chat(session, config, "What is in the picture?", picture)
    assert isinstance(session.conv, ConversationState)  # came back from the worker without the model
    after_first = session.conv.seen
    second = chat(session, config, "And what colour is it?")
    assert not second.new_chat and len(session.history) == 2 and session.conv.seen > after_first
    state, buffer = session.chat, io.BytesIO()
    pickler = StrictPickler(buffer)
    pickler.dump(state)
    assert buffer.tell() <= allowance(state, pickler.tensors)
    assert len(set(zero_gpu.pids)) == len(zero_gpu.pids) == 2  # a fresh worker on every call
    session.close()


def test_mpic_turn_stores_its_media_for_the_app(zero_gpu, picture):
    session, mpic = service.Session(), settings("mpic", params={"mpic": {"k": 2}})
    view = chat(session, mpic, "Describe it.", picture)
    assert view.mpic is not None and session.last_mpic is not None
    library = service.media_library(session)  # read in this process: what the worker stored came back
    assert [row.label for row in library] == ["board.png"] and library[0].on_disk
    reused_first = sum(map(len, session.chat.reused))
    again = chat(session, mpic, "Describe it once more.", picture)
    assert not again.new_chat and again.mpic.reused > 0 and again.mpic.visuals == ["linked"]
    assert sum(map(len, session.chat.reused)) > reused_first > 0  # the chat's reused tokens carried over
    assert service.mpic_ttft(session).tokens > 0  # a regular (non-generator) GPU function too
    session.close()


def test_compare_keeps_its_reference_and_asks_for_more_time_per_method(zero_gpu, picture):
    session = service.Session()
    prepared = service.prepare("What is in the picture?", [picture])
    views = list(service.compare(session, settings("full"), ["streamingllm", "h2o"], prepared))
    assert views[-1].done and [r.name for r in views[-1].runs] == ["full", "streamingllm", "h2o"]
    assert len(session.chat.references.results) == 1
    again = list(service.compare(session, settings("full"), ["snapkv"], prepared))
    assert again[-1].runs[0].turns[0].cached  # the reference came back out of the first worker
    one, three = zero_gpu.seconds[-1], zero_gpu.seconds[0]
    assert three > one  # the duration grows with the methods compared


def test_duration_grows_with_frames_images_and_tokens(picture):
    base = service.prepare("hi", [])
    image = service.prepare("hi", [picture])
    short = service.plan_turn(settings("full"))
    long = service.plan_turn(service.Settings.make(model=MODEL, max_new_tokens=200))
    seconds = service.chat_on_gpu.duration
    empty = service.ChatState()
    assert seconds(empty, short, base, "s") < seconds(empty, short, image, "s") < seconds(empty, long, image, "s")
    assert seconds(empty, long, image, "s") <= zerogpu.MAX_SECONDS
    video = str(Path(__file__).resolve().parents[1] / "assets" / "bouncing_ball.mp4")
    few, many = service.prepare("hi", [video], num_frames=2), service.prepare("hi", [video], num_frames=8)
    assert seconds(empty, short, few, "s") < seconds(empty, short, many, "s")
