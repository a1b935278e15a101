"""Stored media KV into prompts: the runtime half of MPIC (the method half is ``backends/mpic.py``).

* :func:`ingest` is the upload step (MPIC Fig. 5, step 1): an image or a video goes through the
  vision encoder and the language model once, after a fixed prefix (system prompt, user header),
  and its visual embeddings, rotary ids and per-layer KV go to the session's media store (:class:`~.store_api.MediaStore`).
* :class:`Linker` sits in a :class:`~kv_arena.runtime.generate.Conversation` (``linker=``) and drives
  a backend that is a :class:`~backends.media_reuse.ReusesMedia`. For ``reuse == "media"`` it looks
  up every image and video of a prompt by content hash (disk loads start at once and run while the
  prompt is prepared and computed), turns each hit into a ``StoredMedia`` with its rotary shift,
  builds the input embeddings of the tokens the backend recomputes (stored embeddings: no vision
  encoder on a hit), and runs the backend's forward steps.
  For ``reuse == "prefix"`` it restores the longest exact token prefix of an earlier prompt.
* A miss (never stored, expired, evicted, another session's, a damaged file) is recomputed: the
  span is fed in full, or, if a file fails half-way through a forward pass, the linked tokens are
  dropped and the prompt is computed as without a cache.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from kv_arena import backends
from kv_arena.backends.media_reuse import ReusesMedia, StoredMedia

from ..media import Video, load_image, load_video
from ..runtime.attention import active_run
from ..runtime.forward import position_ids
from ..runtime.generate import Conversation
from ..runtime.inputs import DEFAULT_SYSTEM, Chunk, Message
from ..runtime.models import LoadedModel
from .kv_store import CorruptEntry, Entry, LoadTimeout
from .store_api import MediaStore

# stored first, so a disk load delivers them before any layer
EMBEDS, ROPE, DEEPSTACK = "embeds", "rope", "deepstack"


def media_key(media) -> str:
    """Content hash of a decoded image or sampled video (what the model sees, not the file name)."""
    h = hashlib.sha256()
    if isinstance(media, Video):
        h.update(f"video {media.frames.shape} {list(media.timestamps)}".encode())
        h.update(media.frames.tobytes())
    else:
        h.update(f"image {media.mode} {media.size}".encode())
        h.update(media.tobytes())
    return h.hexdigest()


def recomputed(exc: Exception, otherwise: str) -> str:
    """Why a stored entry was not used, as the status line says it: a load that timed out says so
    (the store may be slow, not the entry damaged), anything else ``otherwise``."""
    return f"recomputed ({exc})" if isinstance(exc, LoadTimeout) else f"recomputed ({otherwise})"


class _Stop(Exception):
    """Raised at the language model's entry once its inputs are captured."""


@dataclass
class LanguageInputs:
    """What the language model receives for a chunk: (1, q, hidden) input embeddings (text and
    visual tokens merged) and, for DeepStack models (Qwen3-VL), the visual features each of the
    first decoder layers adds to its output, dense: (layers, q, hidden), zero on text tokens."""

    embeds: torch.Tensor
    deepstack: torch.Tensor | None = None


def _language_inputs(kwargs: dict) -> LanguageInputs:
    embeds, features = kwargs["inputs_embeds"], kwargs.get("deepstack_visual_embeds")
    if features is None:
        return LanguageInputs(embeds)
    mask = kwargs["visual_pos_masks"][0].to(embeds.device)
    dense = embeds.new_zeros(len(features), embeds.shape[1], embeds.shape[2])
    dense[:, mask] = torch.stack(features).to(embeds.device, embeds.dtype)
    return LanguageInputs(embeds, dense)


def deepstack_layers(loaded: LoadedModel) -> int:
    """Decoder layers that receive DeepStack features (0 for models without DeepStack)."""
    vision = getattr(loaded.model.config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


@contextmanager
def capture_embeddings(loaded: LoadedModel, stop: bool = False):
    """Record what the language model receives (:class:`LanguageInputs`); ``stop`` ends the
    forward pass there, so only the vision encoder runs."""
    seen: list[LanguageInputs] = []

    def hook(module, args, kwargs):
        seen.append(_language_inputs(kwargs))
        if stop:
            raise _Stop

    handle = loaded.language_model().register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    except _Stop:
        pass
    finally:
        handle.remove()


def encode_chunk(conv: Conversation, chunk: Chunk) -> LanguageInputs:
    """The language model's inputs for a chunk, the vision encoder run as the model runs it."""
    dev = conv.loaded.device
    with capture_embeddings(conv.loaded, stop=True) as seen:
        conv.loaded.model(input_ids=chunk.input_ids.to(dev), position_ids=position_ids(chunk.rope_ids.to(dev)),
                          use_cache=False, **conv.loaded.on_device(chunk.model_kwargs))
    return seen[0]


@torch.inference_mode()
def ingest(loaded: LoadedModel, store: MediaStore, session: str, media, *, video: bool | None = None,
           num_frames: int = 8, system_prompt: str | None = DEFAULT_SYSTEM, label: str = "") -> str:
    """Compute and store one image's or video's KV after the fixed prefix; returns its key.
    ``media``: a path, a PIL image or a :class:`Video`; pass ``video=True`` for a video path."""
    is_video = isinstance(media, Video) if video is None else video
    media = load_video(media, num_frames) if is_video else load_image(media)
    key, model = media_key(media), loaded.spec.name
    if store.get(session, model, key) is not None:
        return key
    message = Message(videos=[media], num_frames=num_frames) if is_video else Message(images=[media])
    chunk = loaded.adapter.encode_turn(message, 0, 0, system_prompt, (), open_turn=True, close_turn=False)
    conv = Conversation(loaded, backends.make_reference(), system_prompt)
    with capture_embeddings(loaded) as seen:
        conv.forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs)
    first, end = chunk.layout.visuals[0].span
    tensors = {EMBEDS: seen[0].embeds[0, first:end], ROPE: chunk.rope_ids[:, first:end]}
    if seen[0].deepstack is not None:
        tensors[DEEPSTACK] = seen[0].deepstack[:, first:end]
    for i, layer in enumerate(conv.cache.layers):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = layer.keys[:, :, first:end], layer.values[:, :, first:end]
    store.put(session, model, key, tensors, {"kind": "video" if is_video else "image", "tokens": end - first,
                                             "layers": len(conv.cache.layers), "label": label})
    return key


class Linker:
    """One session's view of the store, for the prompts of one conversation."""

    def __init__(self, store: MediaStore, session: str):
        self.store, self.session = store, session
        self.keys: list[str] = []  # content keys of the message being encoded, in layout order
        self.status: list[str] = []  # per visual of the last prompt: "linked" or why it was recomputed

    def resolve(self, message: Message) -> Message:
        """Decode the message's media once (the adapter then reuses them) and hash them."""
        images = [load_image(i) for i in message.images]
        videos = [load_video(v, message.num_frames) for v in message.videos]
        self.keys = [media_key(m) for m in images + videos]
        return replace(message, images=images, videos=videos)

    def prefill(self, conv: Conversation, chunk: Chunk) -> tuple[torch.Tensor, float]:
        """Prefill ``chunk`` reusing what the backend asks for; (last logits, method overhead)."""
        reuse = conv.backend.reuse if isinstance(conv.backend, ReusesMedia) else None
        self.status = ["recomputed"] * len(chunk.layout.visuals)
        if reuse == "prefix":
            return self._prefix(conv, chunk)
        if reuse != "media" or not chunk.layout.visuals:
            return conv.forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs)
        model = conv.loaded.spec.name
        entries = [self.store.get(self.session, model, key) for key in self.keys]  # disk loads start here
        links = [self._link(chunk, visual, entry, key, i)
                 for i, (visual, entry, key) in enumerate(zip(chunk.layout.visuals, entries, self.keys))]
        if not any(links):
            return conv.forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs)
        try:
            return self._linked(conv, chunk, links, entries)
        except CorruptEntry as exc:  # a load failed half-way: forget the links, compute as without a cache
            self.status = [recomputed(exc, "damaged file")] * len(links)
            return conv.forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs)

    def _link(self, chunk: Chunk, visual, entry: Entry | None, key: str, i: int) -> StoredMedia | None:
        """A store hit as the backend sees it, if its tokens line up with this prompt's."""
        if entry is None:
            self.status[i] = "recomputed (not stored)"
            return None
        first, end = visual.span[0] - chunk.layout.start, visual.span[1] - chunk.layout.start
        try:
            shift = chunk.rope_ids[:, first:end] - entry.tensor(ROPE)
        except (CorruptEntry, RuntimeError) as exc:  # damaged, not loaded in time, or a different token count
            self.status[i] = recomputed(exc, "stored entry unusable")
            return None
        delta = int(shift.flatten()[0])
        if not bool((shift == delta).all()):  # another grid or frame timing: moving it is not a shift
            self.status[i] = "recomputed (stored layout differs)"
            return None
        self.status[i] = "linked"
        return StoredMedia(visual.span, delta, lambda layer: (entry.tensor(f"k.{layer}"), entry.tensor(f"v.{layer}")),
                           entry.meta.get("label") or key[:12])

    def _linked(self, conv: Conversation, chunk: Chunk, links, entries) -> tuple[torch.Tensor, float]:
        """The backend's forward steps over the linked cache, fed from stored embeddings."""
        layout, backend, dev = chunk.layout, conv.backend, conv.loaded.device
        inputs = self._embeddings(conv, chunk, links, entries)
        steps = backend.plan(layout, links)
        start_seen, lengths = conv.seen, conv.cache.tokens_per_layer()
        positions = torch.arange(layout.start, layout.end, device=dev)
        overhead = 0.0
        backend.link(conv.cache.layers, layout, links, conv.rotary, conv.adapter.rope_dims)
        try:
            with _layer_hooks(conv, inputs.deepstack) as hooks:
                for rows in steps:
                    hooks.rows = rows.to(dev)
                    logits, spent = conv.forward(None, chunk.rope_ids[:, rows], layout,
                                                 {"inputs_embeds": inputs.embeds[:, rows.to(dev)]},
                                                 positions=positions[rows.to(dev)], seen=start_seen + layout.length)
                    overhead += spent
        except CorruptEntry:
            backend.abort(lengths)
            conv.rewind(start_seen)
            raise
        backend.unlink()
        return logits, overhead

    def _embeddings(self, conv: Conversation, chunk: Chunk, links, entries) -> LanguageInputs:
        """Text through the embedding table, stored spans (and their DeepStack features) from the
        store; a miss runs the encoder."""
        layout = chunk.layout
        if not all(links):
            inputs = encode_chunk(conv, chunk)
            embeds, deepstack = inputs.embeds[0], inputs.deepstack
        else:
            table = conv.loaded.model.get_input_embeddings()
            ids = chunk.input_ids[0].to(conv.loaded.device)
            text = ~layout.visual_mask(ids.device)
            embeds = torch.empty(len(ids), table.embedding_dim, dtype=table.weight.dtype, device=ids.device)
            embeds[text] = table(ids[text])
            layers = deepstack_layers(conv.loaded)
            deepstack = embeds.new_zeros(layers, *embeds.shape) if layers else None
        for link, entry in zip(links, entries):
            if link is not None:
                first, end = link.span[0] - layout.start, link.span[1] - layout.start
                embeds[first:end] = entry.tensor(EMBEDS).to(embeds.device, embeds.dtype)
                if deepstack is not None:
                    deepstack[:, first:end] = entry.tensor(DEEPSTACK).to(embeds.device, embeds.dtype)
        return LanguageInputs(embeds[None], deepstack)

    # --- prefix caching ------------------------------------------------------------------------
    def _identity(self, chunk: Chunk) -> torch.Tensor:
        """Token ids, with each visual token replaced by a negative id from its content and index."""
        ids = chunk.input_ids[0].clone()
        for visual, key in zip(chunk.layout.visuals, self.keys):
            first, end = visual.span[0] - chunk.layout.start, visual.span[1] - chunk.layout.start
            ids[first:end] = -(int(key[:15], 16) + torch.arange(end - first))
        return ids

    def _prefix(self, conv: Conversation, chunk: Chunk) -> tuple[torch.Tensor, float]:
        """Prefix caching: reuse the KV of the longest exact prefix, compute the rest from scratch."""
        layout, model, dev = chunk.layout, conv.loaded.spec.name, conv.loaded.device
        identity, first_turn = self._identity(chunk), conv.seen == 0
        length, entry = self.store.match_prefix(self.session, model, identity) if first_turn else (0, None)
        length = min(length, layout.length - 1)  # the last token is fed: it yields the first output token
        for visual in layout.visuals:  # never cut through an image: its encoder output is all or nothing
            if visual.span[0] < layout.start + length < visual.span[1]:
                length = visual.span[0] - layout.start
        if length > 0:
            for i, layer in enumerate(conv.cache.layers):
                layer.append(entry.tensor(f"k.{i}")[:, :, :length], entry.tensor(f"v.{i}")[:, :, :length],
                             torch.arange(length, device=dev))
            rest = torch.arange(length, layout.length)
            inputs = encode_chunk(conv, chunk)  # the images are encoded as without a cache
            with _layer_hooks(conv, inputs.deepstack) as hooks:
                hooks.rows = rest.to(dev)
                logits, overhead = conv.forward(None, chunk.rope_ids[:, rest], layout,
                                                {"inputs_embeds": inputs.embeds[:, rest.to(dev)]},
                                                positions=rest.to(dev) + layout.start, seen=layout.end)
        else:
            logits, overhead = conv.forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs)
        chunk_positions = torch.arange(layout.start, layout.end)
        conv.backend.report_prefix(chunk_positions[:length], chunk_positions[length:], len(conv.cache.layers))
        if first_turn:
            kv = {}
            for i, layer in enumerate(conv.cache.layers):
                kv[f"k.{i}"], kv[f"v.{i}"] = layer.keys, layer.values
            self.store.put_prefix(self.session, model, identity, kv)
        return logits, overhead


class _LayerHooks:
    """Hooks around the decoder layers while a linked step runs on embeddings:

    * narrowing: the backend may drop rows between layers (CacheBlend); hidden states, rotary
      tables and the call's positions all follow the rows it keeps;
    * DeepStack: a step fed from embeddings brings no pixels, so the model adds no DeepStack
      features itself; the first layers' outputs get them here, for the rows fed (``rows``, chunk
      indices set before each step) and still going, as the model's own forward adds them."""

    def __init__(self, conv: Conversation, deepstack: torch.Tensor | None):
        self.conv, self.deepstack = conv, deepstack
        self.rows: torch.Tensor | None = None  # chunk rows of the current step
        self.kept: torch.Tensor | None = None  # rows of the step still going, for this forward

    def before_layer(self, index: int):
        def hook(module, args, kwargs):
            if index == 0:
                self.kept = None
            rows = self.conv.backend.narrow_rows()
            hidden = args[0]
            if rows is not None:
                rows = rows.to(hidden.device)
                hidden = hidden[:, rows]
                self.kept = rows if self.kept is None else self.kept[rows]
                active_run().narrow(rows)  # the new keys of the next layers belong to the kept rows only
            if self.kept is None:
                return None
            cos, sin = kwargs["position_embeddings"]  # every layer gets the full step's tables
            kwargs["position_embeddings"] = (cos[:, self.kept], sin[:, self.kept])
            if kwargs.get("position_ids") is not None and kwargs["position_ids"].shape[-1] == cos.shape[1]:
                kwargs["position_ids"] = kwargs["position_ids"][..., self.kept]
            return (hidden, *args[1:]), kwargs
        return hook

    def after_layer(self, index: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            rows = self.rows if self.kept is None else self.rows[self.kept]
            hidden = hidden + self.deepstack[index][rows].to(hidden.dtype)[None]  # zero on text rows
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return hook


@contextmanager
def _layer_hooks(conv: Conversation, deepstack: torch.Tensor | None):
    hooks = _LayerHooks(conv, deepstack)
    layers = conv.loaded.language_model().layers
    handles = [layer.register_forward_pre_hook(hooks.before_layer(i), with_kwargs=True) for i, layer in enumerate(layers)]
    if deepstack is not None:
        # features for layers past a shortened decoder are dropped, as the model's own forward drops them
        handles += [layers[i].register_forward_hook(hooks.after_layer(i)) for i in range(min(len(deepstack), len(layers)))]
    try:
        yield hooks
    finally:
        for h in handles:
            h.remove()
