"""The checks every KV-cache method here passes, for a method's own tests (a plugin's too, docs/plugins.md)::

    from kv_arena import testing
    from my_package import MyMethod

    def test_my_method_passes_the_arenas_checks():
        testing.check_method(MyMethod)  # or one check at a time: testing.check_lossless(MyMethod), ...

Each check takes a method's class (registered or not) or its registered name, runs it on an offline
tiny model (random weights, built here: nothing downloads) and raises AssertionError with one line
saying what failed. Plain functions and asserts: no pytest needed, and none of the app's stack.

* :func:`check_lossless`: at budget 1.0 (with the method's ``lossless_params``) the full cache's
  tokens and bytes, in a first and a second turn.
* :func:`check_budget_held`: at a budget, the prompt's cache holds at most that share of the full
  cache's bytes; a method that ``holds_budget_while_decoding`` still holds it after decoding.
* :func:`check_realised_bytes`: the bytes reported are the bytes of the tensors the layers hold,
  after the prompt and after every decoded token (and a realised fraction, where one is
  reported, is a share).
* :func:`check_second_turn`: a follow-up on the compressed cache answers; each layer holds tokens
  of both turns.

:func:`check_method` runs them all on each tiny model the method runs on.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image

from kv_arena import backends
from kv_arena.backends.base import KVBackend

from .runtime.generate import Conversation
from .runtime.inputs import Message
from .runtime.models import LoadedModel, load_model
from .runtime.vision_tokens import refusal

MODELS = ("tiny-qwen2-vl", "tiny-llava")  # M-RoPE and 1-D RoPE, random weights, offline
BUDGET_SLACK = 0.02  # share of the full cache's bytes a method may be off its budget (rounding, sink tokens)
FIRST = "What is shown?"
FOLLOW_UP = "And in the second image?"


@functools.lru_cache(maxsize=4)
def tiny_model(name: str = MODELS[0]) -> LoadedModel:
    """An offline tiny model, built once per process."""
    return load_model(name)


def sample_image(seed: int, size: int | tuple[int, int] = 224) -> Image.Image:
    """A seeded noise picture, ``size`` px square or (width, height) (64 visual tokens on tiny-qwen2-vl at 224)."""
    width, height = (size, size) if isinstance(size, int) else size
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def first_message(image_size: int = 224) -> Message:
    """The first turn every check asks: a question on two pictures."""
    return Message(FIRST, images=[sample_image(0, image_size), sample_image(1, image_size)])


def method_class(method: str | type[KVBackend]) -> type[KVBackend]:
    """``method`` as a class: a registered name looked up, a KVBackend subclass as it is."""
    if isinstance(method, str):
        return backends.backend_class(method)
    if not (isinstance(method, type) and issubclass(method, KVBackend)):
        raise TypeError(f"a method is a subclass of kv_arena.backends.base.KVBackend or its name; got {method!r}")
    return method


def build(method: str | type[KVBackend], budget: float = 1.0, **params) -> KVBackend:
    """The method built as the registry builds it (``make_backend``): parameters checked, and a
    method without a budget (``uses_budget`` False) built at 1.0."""
    return backends.build(method_class(method), budget, **params)


def _model(model: str | LoadedModel) -> LoadedModel:
    return tiny_model(model) if isinstance(model, str) else model


def _turns(loaded: LoadedModel, backend: KVBackend, tokens: int, image_size: int = 224):
    conv = Conversation(loaded, backend)
    first = conv.ask(first_message(image_size), max_new_tokens=tokens, ignore_eos=True)
    second = conv.ask(Message(FOLLOW_UP), max_new_tokens=tokens, ignore_eos=True)
    return conv, first, second


def check_lossless(method, model: str | LoadedModel = MODELS[0], tokens: int = 12, image_size: int = 224) -> None:
    """At budget 1.0 with ``lossless_params`` the method answers the full cache's tokens and holds
    its bytes, in a first turn and a second one."""
    cls, loaded = method_class(method), _model(model)
    _, *ref = _turns(loaded, backends.make_reference(), tokens, image_size)
    _, *got = _turns(loaded, build(cls, 1.0, **cls.lossless_params), tokens, image_size)
    for turn, (r, g) in enumerate(zip(ref, got), 1):
        assert g.token_ids == r.token_ids, (f"{cls.name} at budget 1.0, turn {turn}: tokens {g.token_ids} "
                                            f"differ from the full cache's {r.token_ids}")
        assert g.metrics.kv_bytes == r.metrics.kv_bytes, (f"{cls.name} at budget 1.0, turn {turn}: holds "
                                                          f"{g.metrics.kv_bytes} bytes, the full cache {r.metrics.kv_bytes}")


def check_budget_held(method, model: str | LoadedModel = MODELS[0], budget: float = 0.5, tokens: int = 32,
                      **params) -> None:
    """After the prompt the cache holds at most ``budget`` of the full cache's bytes; a method that
    ``holds_budget_while_decoding`` holds ``budget`` of them still after every decoded token. Not
    checked: a method without a budget (its own knob decides), one built around a streamed video's
    cap (``cap_replaces_budget``: InfiniPot-V holds a picture whole), one that says in ``report.note``
    it left this prompt whole (EVS on pictures); one that ``resizes_media`` is held to the budget's
    share of the visual tokens (its prompt is shorter, the text whole)."""
    cls, loaded = method_class(method), _model(model)
    if not cls.uses_budget or cls.cap_replaces_budget:
        return
    full = Conversation(loaded, backends.make_reference()).ask(first_message(), max_new_tokens=tokens, ignore_eos=True)
    conv = Conversation(loaded, build(cls, budget, **params))
    got = conv.ask(first_message(), max_new_tokens=tokens, ignore_eos=True)
    if conv.backend.report.note:
        return
    if cls.resizes_media:
        visual, whole = got.metrics.visual_tokens, full.metrics.visual_tokens
        assert visual <= budget * whole, f"{cls.name} at budget {budget}: the prompt has {visual} of {whole} visual tokens"
        return
    prefill = got.metrics.kv_bytes_prefill / full.metrics.kv_bytes_prefill
    assert prefill <= budget + BUDGET_SLACK, (f"{cls.name} at budget {budget}: holds {prefill:.3f} of the full "
                                              f"cache's bytes after the prompt")
    if cls.holds_budget_while_decoding:
        for step, (held, whole) in enumerate(zip(got.metrics.kv_trace, full.metrics.kv_trace)):
            assert abs(held / whole - budget) <= BUDGET_SLACK, (
                f"{cls.name} at budget {budget}: holds {held / whole:.3f} of the full cache's bytes after "
                f"{step} decoded tokens (it holds_budget_while_decoding)")


def check_realised_bytes(method, model: str | LoadedModel = MODELS[0], budget: float = 0.5, tokens: int = 8,
                         **params) -> None:
    """The bytes reported after the prompt and after every decoded token are the bytes of every
    tensor the layers hold (``KVLayer.tensors``); a ``report.realised_fraction``, where the method
    reports one (those without a budget), lies in (0, 1]."""
    cls = method_class(method)
    conv = Conversation(_model(model), build(cls, budget, **params))
    update = conv.ask(first_message(), max_new_tokens=tokens, ignore_eos=True)
    held = sum(t.numel() * t.element_size() for layer in conv.cache.layers for t in layer.tensors())
    metrics = update.metrics
    assert metrics.kv_bytes == held == conv.cache.nbytes(), (f"{cls.name}: reports {metrics.kv_bytes} bytes, its "
                                                             f"layers' tensors hold {held}")
    assert len(metrics.kv_trace) == metrics.new_tokens and metrics.kv_trace[-1] == metrics.kv_bytes, (
        f"{cls.name}: {len(metrics.kv_trace)} byte counts for {metrics.new_tokens} tokens (one after the prompt, "
        f"one after each token fed)")
    assert metrics.kv_trace[0] == metrics.kv_bytes_prefill, f"{cls.name}: the bytes after the prompt are not the trace's first"
    fraction = conv.backend.report.realised_fraction
    assert fraction is None or 0 < fraction <= 1, f"{cls.name}: reports a realised fraction of {fraction}"


def check_second_turn(method, model: str | LoadedModel = MODELS[0], budget: float = 0.5, tokens: int = 6,
                      **params) -> None:
    """A follow-up answered on the compressed cache: every layer holds tokens of both turns; a
    method that ``holds_budget_while_decoding`` holds ``budget`` of the tokens seen (one more: the
    last token decoded)."""
    cls = method_class(method)
    conv, _, second = _turns(_model(model), build(cls, budget, **params), tokens)
    assert second.metrics.new_tokens == tokens, f"{cls.name}: the follow-up answered {second.metrics.new_tokens} tokens"
    start = conv.layouts[1].start
    for i, kept in enumerate(conv.cache.kept_positions()):
        assert (kept < start).any() and (kept >= start).any(), f"{cls.name}: layer {i} lost one turn's tokens"
        if cls.uses_budget and cls.holds_budget_while_decoding:
            assert kept.shape[1] <= math.ceil(budget * conv.seen) + 1, (
                f"{cls.name} at budget {budget}: layer {i} holds {kept.shape[1]} of {conv.seen} tokens seen")


CHECKS = (check_lossless, check_budget_held, check_realised_bytes, check_second_turn)


def runs_on(method, model: str | LoadedModel) -> bool:
    """Whether the runtime lets the method run on ``model`` at the checks' budget (VisionZip needs
    LLaVA-1.5's CLIP tower; Downsample, a processor that sizes pictures freely)."""
    return refusal(_model(model).model, build(method, 0.5)) is None


def check_method(method, models: tuple[str, ...] = MODELS) -> None:
    """Every check (:data:`CHECKS`) on every model of ``models`` the method runs on (at least one)."""
    ran = [model for model in models if runs_on(method, model)]
    assert ran, f"{method_class(method).name} runs on none of {', '.join(models)}"
    for model in ran:
        for check in CHECKS:
            check(method, model)
