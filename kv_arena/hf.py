"""Any registered KV-cache method on a stock transformers model, through ``model.generate``.

    from kv_arena.hf import compress

    with compress(model, "snapkv", budget=0.2, window_size=16) as press:
        out = model.generate(**inputs, cache=press.cache, max_new_tokens=64)
    press.nbytes(), press.full_nbytes(), press.kept_positions(), press.report

(transformers before 5.24 names the cache ``past_key_values``: ``generate(**inputs,
past_key_values=press.cache)``; ``press.keyword`` is the name the installed release takes.)

What it uses of transformers, nothing patched:

* the text model's attention is the runtime's function, registered with ``AttentionInterface``
  (``kv_arena.runtime.attention``) and selected for the text config only while the block runs;
* ``press.cache`` is a ``Cache`` (``kv_arena.runtime.cache.KVCache``) whose layers are the method's:
  ``generate`` stores into it, and its ``get_seq_length`` is the uncompressed history, so
  ``generate`` feeds only what the cache has not seen and a second ``generate`` on the whole
  conversation continues it;
* two PyTorch forward hooks, on the model (the prompt's token ids, where the media sit) and on its
  language model (the rotary ids the model computed, the new tokens' count; the method's
  once-per-forward step afterwards), describe each forward pass to the method as the app's runtime
  describes it, so both give the same tokens (``tests/test_hf_entry_point.py``); for a method
  that runs later layers on fewer rows (FastV) the runtime's pre-hooks on the decoder layers
  (``kv_arena.runtime.narrowing``) shorten them, as in the app; for a method that chooses an image's
  tokens before the decoder (VisionZip), hooks on the vision tower and the projector
  (``kv_arena.runtime.vision_tokens``) hand it what the tower computed, as in the app.

A method that shrinks the media before the vision tower (Downsample) needs its inputs made for it:
``Chat.turn`` called inside the ``compress`` block sizes the pictures and frames as the method asks
(``media_scale``), as the app does; a model whose processor sizes every picture to a fixed grid refuses it.

Batch 1, as in the app. A method that only acts on media KV the app's runtime stored
(a :class:`~backends.media_reuse.ReusesMedia`: MPIC) is refused: inside ``generate`` it would be the full cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from kv_arena import backends
from kv_arena.backends.base import AttentionCall, KVBackend, Report
from kv_arena.backends.layout import PromptLayout, VisualSpan
from kv_arena.backends.media_reuse import ReusesMedia

from .runtime.attention import ATTENTION_NAME, ForwardRun, forward_run
from .runtime.cache import KVCache
from .runtime.forward import cache_keyword, rotary_of
from .runtime.inputs import ADAPTERS, DEFAULT_SYSTEM, Message
from .runtime.models import load_model
from .runtime.narrowing import narrowing
from .runtime.vision_tokens import check_runs_on, selecting_visual_tokens

_PRESS: ContextVar[Press | None] = ContextVar("kv_arena_press", default=None)  # the compress block running


class GenerateCache(KVCache):
    """The method's cache as ``generate`` sees it: its length is every token fed (the
    uncompressed history), which is what ``generate`` slices new inputs and derives positions by."""

    def __init__(self, backend: KVBackend, num_layers: int):
        super().__init__(backend, num_layers)
        self.seen = 0  # tokens fed so far, kept or not

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen


class Press:
    """A method applied to one model: its cache for ``generate`` and what it held afterwards."""

    def __init__(self, model, backend: KVBackend):
        self.model, self.backend = model, backend
        self.text_config = model.config.get_text_config()
        self.decoder = model.get_decoder()
        self.cache = GenerateCache(backend, self.text_config.num_hidden_layers)
        self.keyword = cache_keyword(model)  # "cache" (transformers >= 5.24) or "past_key_values"
        self.steps = 0  # decode forwards so far (AttentionCall.step)
        self._ids: torch.Tensor | None = None  # token ids of the forward pass about to run
        self._run = None  # (ForwardRun, context) of the forward pass running now

    # --- what it held --------------------------------------------------------------------------
    @property
    def report(self) -> Report:
        """The method's own report (kept positions, per-layer budgets, its fields)."""
        return self.backend.report

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds for attention (codes, scales, factors included)."""
        return self.cache.nbytes()

    def full_nbytes(self) -> int:
        """Bytes the full cache would hold for the same tokens, in the model's dtype."""
        cfg = self.text_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        element = torch.finfo(self.model.dtype).bits // 8
        return 2 * cfg.num_hidden_layers * kv_heads * head_dim * element * self.cache.seen

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer, the (H_kv, S) token indices held (merged entries report their anchor)."""
        return self.cache.kept_positions()

    def reset(self) -> None:
        """Forget the conversation: an empty cache for the next ``generate``."""
        self.cache = GenerateCache(self.backend, self.text_config.num_hidden_layers)
        self.backend.reset_report()
        self.steps = 0

    # --- each forward pass, described to the method ------------------------------------------------
    def before_model(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._ids = ids if isinstance(ids, torch.Tensor) else None

    def before_decoder(self, module, args, kwargs):
        # either name: generate renames the old one on the way in on releases that have the new one
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not self.cache:
            raise ValueError(f"compress(...): pass {self.keyword}=press.cache to generate (or to the model call)")
        embeds = kwargs.get("inputs_embeds")
        batch, q = embeds.shape[:2]
        if batch != 1:
            raise ValueError(f"compress(...) runs batch 1, as the arena's runtime does; got a batch of {batch}")
        start = cache.seen
        positions = torch.arange(start, start + q, device=embeds.device)
        cache.pending_positions = positions
        rope_ids = self._rope_ids(kwargs.get("position_ids"), positions)
        phase = "prefill" if q > 1 else "decode"
        self.steps += phase == "decode"  # counted as the runtime counts them: a decode call knows its number
        call = AttentionCall(layer_idx=0, num_layers=len(cache.layers), phase=phase, positions=positions,
                             rope_ids=rope_ids, layout=self._layout(start, q) if phase == "prefill" else None,
                             seen=start + q, step=self.steps, rotary=self._rotary)
        run = ForwardRun(cache, call)
        context = forward_run(run)
        context.__enter__()
        self._run = (run, context)

    def after_decoder(self, module, args, kwargs, output):
        if self._run is None:
            return
        (run, context), self._run = self._run, None
        try:
            self.cache.seen = run.call.seen  # every token fed, rows a method dropped between layers included
            run.timed(self.backend.after_forward, self.cache, run.call)
        finally:
            context.__exit__(None, None, None)
            self._ids = None

    def _rope_ids(self, position_ids, positions: torch.Tensor) -> torch.Tensor:
        """(P, q) rotary ids of the new tokens: the model's M-RoPE rows (its text row, if any, left
        out), else its 1-D positions; without any, the absolute positions, as the model would."""
        if position_ids is None:
            return positions[None].cpu()
        if position_ids.dim() == 3:
            return position_ids[-3:, 0].cpu()
        return position_ids[:1].cpu()

    def _rotary(self, rope_ids: torch.Tensor):
        """(P, n) rotary ids -> (cos, sin) of shape (1, n, D), from the model's own rotary module."""
        return rotary_of(self.decoder)(rope_ids)

    def _layout(self, start: int, q: int) -> PromptLayout:
        """Where the images and videos of the new tokens sit: each run of the config's image or
        video token id is one span (the frames of a Qwen3-VL video, split by timestamps, are runs)."""
        if self._ids is None or self._ids.shape[-1] < q:
            return PromptLayout(start, start + q, text=[(start, start + q)])
        kinds = {getattr(self.model.config, "image_token_id", None): "image",
                 getattr(self.model.config, "video_token_id", None): "video"}
        values, counts = torch.unique_consecutive(self._ids[0, -q:].cpu(), return_counts=True)
        layout, at = PromptLayout(start, start + q), start
        for value, count in zip(values.tolist(), counts.tolist()):
            kind = kinds.get(value)
            if kind is None:
                layout.text.append((at, at + count))
            else:
                layout.visuals.append(VisualSpan(kind, (at, at + count)))
            at += count
        return layout


@contextmanager
def compress(model, method: str, budget: float = 1.0, **params):
    """Apply ``method`` (any registered name, or a stack such as ``snapkv+fp8``; its parameters as
    keywords) to ``model`` while the block runs; pass ``cache=press.cache`` to ``generate``
    (``past_key_values=`` before transformers 5.24; both are taken where the release takes both). The press stays readable
    (and its cache usable by another ``compress`` block) after the block."""
    cls = backends.backend_class(method)
    if issubclass(cls, ReusesMedia):
        raise ValueError(f"{method} reuses media KV that the arena's runtime stored (kv_arena.mpic); inside a plain "
                         "model.generate there is nothing stored and it would be the full cache. Use "
                         "kv_arena.runtime.generate.Conversation with an kv_arena.mpic.linking.Linker instead.")
    press = Press(model, backends.make_backend(method, budget=budget, **params))
    check_runs_on(model, press.backend)  # a model that cannot serve it (no CLS token, a fixed grid): one line
    token = _PRESS.set(press)  # Chat.turn sizes the media for it (a method that resizes them)
    try:
        with (attention_of(model, ATTENTION_NAME), narrowing(model, press.backend),
              selecting_visual_tokens(model, press.backend)):
            handles = [model.register_forward_pre_hook(press.before_model, with_kwargs=True),
                       press.decoder.register_forward_pre_hook(press.before_decoder, with_kwargs=True),
                       press.decoder.register_forward_hook(press.after_decoder, with_kwargs=True, always_call=True)]
            try:
                yield press
            finally:
                for handle in handles:
                    handle.remove()
    finally:
        _PRESS.reset(token)


@contextmanager
def attention_of(model, name: str):
    """The text model runs attention ``name`` inside the block; everything is restored after it."""
    text = model.config.get_text_config()
    vision = getattr(model.config, "vision_config", None)
    # transformers sets the implementation through a public door but reads it back through none
    before = {"text_config": text._attn_implementation}
    if vision is not None:
        before["vision_config"] = vision._attn_implementation
    model.set_attn_implementation(before | {"text_config": name} if vision is not None else name)
    try:
        yield
    finally:
        model.set_attn_implementation(before if vision is not None else before["text_config"])


class Chat:
    """Inputs for ``generate`` in the arena's prompt format for the model's family (chat markers,
    image tokens, videos patchified without torchvision; M-RoPE's ``mm_token_type_ids``).

        chat = Chat(model, tokenizer, image_processor)  # LLaVA also takes its processor
        inputs = chat.turn("What is shown?", images=["a.png"])
        out = model.generate(**inputs, cache=press.cache, max_new_tokens=32)
        inputs = chat.turn("And on the left?", after=out)  # the whole conversation: generate feeds the new part

    A follow-up carries text (transformers' Qwen-VL recomputes positions over the whole conversation
    with the grids of the media passed, so new media belong in a first turn)."""

    def __init__(self, model, tokenizer, image_processor, processor=None, system: str | None = DEFAULT_SYSTEM):
        family = model.config.model_type
        if family not in ADAPTERS:
            raise ValueError(f"no chat format for model type '{family}'; known: {', '.join(ADAPTERS)}")
        self.adapter = ADAPTERS[family](model, tokenizer, image_processor, processor)
        self.system = system

    def turn(self, text: str, images=(), videos=(), num_frames: int = 8, after: torch.Tensor | None = None) -> dict:
        adapter = self.adapter
        message = Message(text, images=list(images), videos=list(videos), num_frames=num_frames)
        press = _PRESS.get()
        scale = press.backend.media_scale() if press is not None and press.model is adapter.model else 1.0
        if after is None:
            chunk = adapter.encode_turn(message, 0, 0, self.system, media_scale=scale)
            ids = chunk.input_ids
        else:
            if images or videos:
                raise ValueError("Chat.turn: a follow-up carries text; start a new conversation for new media")
            last = int(after[0, -1])  # generated, not yet fed: its end of turn follows it
            close = adapter.tokens(adapter.assistant_close) if last in adapter.eos_ids else adapter.end_of_turn_ids()
            chunk = adapter.encode_turn(message, 0, 0, None, close)
            ids = torch.cat([after.cpu(), chunk.input_ids], dim=1)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)} | dict(chunk.model_kwargs)
        if adapter.rope_dims == 3:  # which tokens are an image's (1) or a video's (2)
            types = torch.zeros_like(ids, dtype=torch.int)
            types[ids == adapter.config.image_token_id] = 1
            types[ids == adapter.config.video_token_id] = 2
            inputs["mm_token_type_ids"] = types
        return inputs


def save_offline(name: str, path) -> str:
    """Write one of the arena's offline models (e.g. ``tiny-qwen3-vl``, random weights) as a
    checkpoint folder that ``from_pretrained`` loads: model, tokenizer and PIL image processor."""
    loaded = load_model(name)
    model = loaded.model
    model.set_attn_implementation("sdpa")  # what a stock checkpoint asks for
    model.save_pretrained(path)
    adapter = loaded.adapter
    adapter.tokenizer.save_pretrained(path)
    adapter.image_processor.save_pretrained(path)
    if adapter.processor is not None:
        adapter.processor.save_pretrained(path)
    return str(path)
