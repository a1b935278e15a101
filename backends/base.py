"""The one small interface every KV-cache method implements.

A backend sees the language model's attention layer by layer, through four seams that the
runtime (``kv_arena/``) calls; it never imports the runtime or the UI:

* ``new_layer(i)``            -> the :class:`KVLayer` that stores layer ``i``'s keys and values.
  Subclass it for caches that pack low-bit codes or low-rank factors and rebuild on read.
* ``attend(call, q, k, v)``    -> replace the attention itself (token-sparse prefill, selective
  recompute); return ``None`` to let the runtime run exact causal attention.
* ``after_attention(call, layer, q, k)`` -> per layer, right after its attention: score from the
  post-RoPE queries you need and compress this layer now (its cache is not read again in this
  forward pass, so evicting here lowers the peak too).
* ``after_forward(cache, call)`` -> once all layers ran: decisions that need every layer
  (per-layer budgets), and decode-time eviction.

A method may also shorten the prefill itself: with ``narrows_prefill`` the runtime asks
``prefill_rows(call)`` before each decoder layer of a prefill, and the rows it returns (indices
among the new tokens still going) are the only ones that layer and every later one compute and
cache (FastV: the visual tokens kept after layer K). Their positions stay the original ones.

A method may also shrink the media before the vision tower (``resizes_media``: Downsample): the
runtime sizes each picture and video frame so that it makes the ``media_scale()`` share of the
visual tokens the model's processor would make (a smaller upload, aspect kept, on the processor's
patch grid); a model whose processor sizes every picture to a fixed grid refuses the method in one line.

A method may also choose an image's tokens before the decoder sees them (``selects_visual_tokens``:
VisionZip): the runtime hands ``select_visual(tokens)`` what the vision tower computed for the
images of a forward pass (:class:`VisionTokens`), the method returns the features the projector is
to read (merged ones written in place), and through ``prefill_rows`` before the first decoder layer
it drops the rows of the tokens it did not keep. A model whose tower lacks what the method reads is
refused by the runtime in one line.

``before_forward(cache, call)`` opens each forward pass (before the first layer reads the cache):
what a method needs from the runtime for one pass only, such as ``call.rotary``, is taken there
and dropped in ``after_forward``, so a cache between passes holds tensors, never the model.

Two optional read-side extensions keep scoring and compressed reads off a second pass:
``needs_prefill_column_sums`` asks the runtime's prefill attention for the attention each key
received from the new queries (``call.column_sums``, computed in the same pass), and a layer's
``read_decode(query, scaling)`` answers a decode query from its stored form (codes, factors) instead
of rebuilding dense keys and values.

A method that reuses media KV stored beforehand (MPIC) also implements the second protocol,
:class:`~backends.media_reuse.ReusesMedia`, through which the runtime links the stored KV in.

A long video may stream in: the runtime prefills it a few frames at a time and, for a method
with ``streams_under_cap``, sets ``call.cap_bytes`` on each chunk; the method then evicts through
the same seams until the whole cache holds at most that many bytes (``call.cap_entries(layer)``:
a layer's equal share, in entries). A cap below what a method never evicts is refused with
:class:`CapTooSmall`, which names the smallest cap the method can hold.

Keys arrive post-RoPE, shape ``(1, H_kv, S, D)``; queries ``(1, H, q, D)``. Batch is always 1.

Beside this module: a method's parameters are declared with :mod:`backends.params`, the prompt
it is told about is a :mod:`backends.layout`, and :mod:`backends.descriptions` describes a method
to the UI and the CLI in plain values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

import torch
from transformers.cache_utils import DynamicLayer

from .layout import PromptLayout
from .params import BUDGET, Param

# ---------------------------------------------------------------------------------------------
# What a backend is told about the current forward pass
# ---------------------------------------------------------------------------------------------


class CapTooSmall(ValueError):
    """A streamed prefill's memory cap below the bytes a method never evicts; its message, one
    line for the user, names the smallest cap the method can hold (``smallest_bytes``)."""

    def __init__(self, title: str, cap_bytes: int, smallest_bytes: int, kept: str, room_from: int | None = None):
        self.smallest_bytes = smallest_bytes
        room = f"; it keeps video tokens from {_kib(room_from)}" if room_from else ""
        super().__init__(f"{title} cannot hold the cache under a cap of {_kib(cap_bytes)}: it never evicts {kept} "
                         f"({_kib(smallest_bytes)} here), the smallest cap it can hold{room}.")


def _kib(size: int) -> str:
    return f"{size / 2**20:.2f} MB" if size >= 2**20 else f"{math.ceil(size / 2**10 * 10) / 10:.1f} KiB"


@dataclass
class AttentionCall:
    """One layer's attention in one forward pass, as the runtime describes it to the backend."""

    layer_idx: int
    num_layers: int
    phase: str  # "prefill" (several new tokens) or "decode" (one)
    positions: torch.Tensor  # (q,) absolute token indices of the new tokens
    rope_ids: torch.Tensor  # (P, q) rotary position ids of the new tokens (P = 1, or 3 for M-RoPE)
    layout: PromptLayout | None  # this chunk's layout (None while decoding)
    seen: int  # tokens in the conversation including the new ones
    step: int  # decode step (0 during prefill)
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None  # rope_ids -> (cos, sin)
    # (H, S) float32 attention each held key received from the new queries, set by the runtime's
    # prefill attention for backends with ``needs_prefill_column_sums`` (None otherwise, e.g. when
    # ``attend`` took over)
    column_sums: torch.Tensor | None = None
    # a streamed prefill (a long video fed a few frames at a time): the bytes the whole cache may
    # hold once this chunk is done; a method that ``streams_under_cap`` evicts down to it (None: no cap)
    cap_bytes: int | None = None
    # (1, q, C) the hidden states entering decoder layer ``layer_idx`` of a prefill, the rows still
    # going: set only in the call handed to ``prefill_rows`` (before the first layer: the prompt's
    # input embeddings, a video's tokens as its vision tower made them; EVS compares frames by them)
    hidden: torch.Tensor | None = None

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    def cap_entries(self, layer: KVLayer) -> int | None:
        """Entries per KV head ``layer`` may hold under ``cap_bytes`` (every layer an equal share of
        the cap, at the bytes per entry it holds now), or None without a cap."""
        held = layer.get_seq_length()
        if self.cap_bytes is None or held == 0:
            return None
        per_entry = layer.nbytes() / held
        return max(1, int(self.cap_bytes / self.num_layers // per_entry))


@dataclass
class VisionTokens:
    """What a vision tower with a CLS token (CLIP) computed for the B images of one forward pass, at
    the layer whose output the projector reads: the runtime's hand-over to ``select_visual``."""

    features: torch.Tensor  # (B, N, C) the patch features the projector reads (CLS excluded)
    cls_query: torch.Tensor  # (B, H, D) the CLS token's query in that layer's attention
    keys: torch.Tensor  # (B, H, N + 1, D) every token's key in that attention, the CLS token's first
    scaling: float  # that attention's softmax scale


# ---------------------------------------------------------------------------------------------
# Storage: one layer of the cache
# ---------------------------------------------------------------------------------------------


class KVLayer(DynamicLayer):
    """A dense layer that also remembers which token each cached entry came from.

    ``positions`` has shape ``(H_kv, S)``: heads may keep different tokens (same count), which
    saves real memory, unlike masking. ``update`` must return keys/values that end with the new
    tokens in order, because the runtime's causal mask assumes it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.positions: torch.Tensor | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """Store new tokens; return the full (dense, post-RoPE) keys and values for attention."""
        heads = keys.shape[1]
        new_pos = positions.to(keys.device).view(1, -1).expand(heads, -1)
        self.positions = new_pos.clone() if self.positions is None else torch.cat([self.positions, new_pos], dim=1)
        return DynamicLayer.update(self, keys, values)

    # transformers calls ``update``; the cache routes it to ``append`` with positions.
    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - routed by the cache
        raise RuntimeError("KVLayer.update is called through the runtime's cache, which passes positions")

    # --- edits backends make -----------------------------------------------------------------
    def keep(self, index: torch.Tensor) -> None:
        """Keep only the entries at ``index``: shape (S',) for all heads or (H_kv, S') per head."""
        heads = self.keys.shape[1]
        if index.dim() == 1:
            index = index.view(1, -1).expand(heads, -1)
        index = index.to(self.keys.device)
        gather = index[None, :, :, None].expand(1, heads, index.shape[1], self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather)
        self.positions = self.positions.gather(1, index)

    def read_decode(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional read path for one decode query (1, H, 1, D): its output (1, H, 1, D) and float32
        softmax row (H, 1, S) over the entries in read order (``kept_positions``), computed from what
        the layer stores. ``None`` (dense layers): the runtime attends over what ``append`` returned.
        A layer that answers here returns only its dense part from ``append_decode``; its result
        must equal attention over the densely rebuilt entries up to float rounding."""
        return None

    def append_decode(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """``append`` of one decode token inside the runtime, which then asks ``read_decode`` first: a
        layer that answers there only stores here and returns its dense part."""
        return self.append(keys, values, positions)

    def replace(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if positions.dim() == 1:
            positions = positions.view(1, -1).expand(keys.shape[1], -1)
        self.keys, self.values, self.positions = keys, values, positions.to(keys.device)

    # --- what it costs -----------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer really holds for attention (codes, scales, factors, buffers)."""
        return [t for t in (self.keys, self.values) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def get_seq_length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def kept_positions(self) -> torch.Tensor:
        """(H_kv, S) token indices held (merged entries report their anchor)."""
        return self.positions


# ---------------------------------------------------------------------------------------------
# What a method reports
# ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    """What a method tells the panels and the benchmarks about its cache (``KVBackend.report``).

    A field left ``None`` is one the method does not report (or has not reported yet). Per-layer
    lists are indexed by layer and hold ``None`` for a layer that has not reported yet. Methods
    with details of their own subclass this next to the method and name it as ``report_type``.
    """

    # per layer: the token positions the layer holds, (H_kv, S) or (S,) when its heads share them
    kept: list[torch.Tensor | None] | None = None
    # per layer: the share of the tokens seen that the layer holds or plans to hold (None: no per-layer plan)
    layer_budgets: list[float | None] | None = None
    # per layer: (1, n) visual token indices the panels draw instead of the kept ones (ZipVL: 4-bit tokens)
    overlay: list[torch.Tensor | None] | None = None
    # MPIC: per layer, the 1-D token positions of this prompt whose KV came from the store
    reused: list[torch.Tensor] | None = None
    # bytes held / the same tokens' bytes in full precision, all layers (methods without a budget)
    realised_fraction: float | None = None
    # one line the app shows beside the method's figures for the last prompt: what it could not act on
    # (EVS on a prompt without a video holds the whole cache and says so, rather than show 1.00x as a result)
    note: str | None = None

    def ensure_layers(self, n: int, *names: str, fill: Any = None) -> None:
        """Make each named per-layer field a list of ``n`` entries (``fill``) unless it already is one."""
        for name in names:
            value = getattr(self, name)
            if value is None or len(value) != n:
                setattr(self, name, [fill] * n)

    def to_dict(self) -> dict[str, Any]:
        """The reported fields by name, for JSON (fields left ``None`` are not reported and left out;
        tensors are left as they are, for the caller to convert)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


# ---------------------------------------------------------------------------------------------
# The method
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)  # identity equality and hash, as for any object
class KVBackend:
    """Base class: the full cache. Subclasses override the seams they need.

    Class attributes describe the method for the registry, the UI and ``kv_arena.bench --list``
    (:func:`backends.descriptions.describe` reads them); what an instance needs from the runtime's
    attention (``needs_*``) are properties, since a method at budget 1.0 may need nothing. A method's parameters are dataclass fields
    made with :func:`backends.params.param` (subclasses are
    ``@dataclass(eq=False)`` too); values may arrive as strings and are coerced on construction.
    """

    name: ClassVar[str] = "full"
    title: ClassVar[str] = "Full cache"
    paper: ClassVar[str] = ""  # URL
    summary: ClassVar[str] = "Keeps every key and value: the reference for every figure."
    # what it does to the cache, in a word or two: keeps, drops, merges, quantises, low-rank, reuses, downsamples
    does: ClassVar[str] = "keeps"
    # True: cache held at budget x tokens seen while decoding; False: the prompt is compressed and
    # decoded tokens are appended.
    holds_budget_while_decoding: ClassVar[bool] = False
    # True: ``budget`` is the fraction of the full cache's bytes the method holds after the prompt,
    # everything its layers hold counted (factors, codes, scales, score buffers). False: the method
    # has its own knob as a named parameter (ZipVL's tau, MPIC's mode), is built with budget 1.0 and
    # is compared at the fraction it realises.
    uses_budget: ClassVar[bool] = True
    # True: the method can hold a streamed prefill under a byte cap (``AttentionCall.cap_bytes``),
    # evicting between chunks as the frames arrive; any method streams without a cap.
    streams_under_cap: ClassVar[bool] = False
    # True: under a streaming cap the cap alone sets what it holds; the budget applies without one
    cap_replaces_budget: ClassVar[bool] = False
    # True for the one method every other is measured against (the full cache): its answers are
    # the references, its own figures are 1.00x by definition
    is_reference: ClassVar[bool] = False
    # its prefill itself runs on fewer tokens (a sparse attention, rows dropped after a layer): the
    # prefill bench (``--mode prefill``) times it against the full cache's
    shortens_prefill: ClassVar[bool] = False
    # what a token drawn clear in the overlay is (``report.overlay`` when set, else the kept tokens)
    overlay_meaning: ClassVar[str] = "kept"
    # True: the method shrinks the media before the vision tower (``media_scale``), so the prompt
    # itself is shorter; a model whose processor sizes every picture to a fixed grid refuses it
    resizes_media: ClassVar[bool] = False
    # True: a store that codes each entry it holds on its own (FP8, INT4) and drops entries through
    # ``KVLayer.keep``: a method that ``chooses_tokens`` can be stacked on it (``snapkv+fp8``, backends.stack)
    quantised_store: ClassVar[bool] = False
    # True: the method changes what the cache holds only by choosing tokens (``KVLayer.keep``, fewer
    # prefill rows or visual tokens) and never reads a layer's stored keys and values, so it can
    # choose what a quantised store holds (the first part of a stack)
    chooses_tokens: ClassVar[bool] = False
    # Parameters that, with budget 1.0, make the method reproduce the full cache exactly (the
    # registry-wide lossless test uses them; e.g. a quantising method turns quantisation off).
    lossless_params: ClassVar[dict[str, Any]] = {}

    # the type of ``report``: a method with details of its own names its :class:`Report` subclass
    report_type: ClassVar[type[Report]] = Report

    budget: float = 1.0
    # filled by the method: kept sets, per-layer budgets... (a fresh ``report_type()`` on construction)
    report: Report = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.report = self.report_type()
        self.budget = BUDGET.coerce(self.budget)
        for p in self.param_specs():
            setattr(self, p.name, p.coerce(getattr(self, p.name)))

    @classmethod
    def param_specs(cls) -> tuple[Param, ...]:
        """The method's parameters (``budget`` aside), from its :func:`~backends.params.param` fields, in field order."""
        return tuple(Param(f.name, f.default, **f.metadata["param"])
                     for f in fields(cls) if "param" in f.metadata)

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Raise a readable ValueError if ``params`` names something that is neither budget nor a parameter."""
        known = [p.name for p in cls.param_specs()]
        unknown = set(params) - set(known) - {"budget"}
        if unknown:
            raise ValueError(f"{cls.name} has no parameter {', '.join(sorted(unknown))}; it takes: {', '.join(known) or 'none'}")

    @property
    def needs_decode_attention(self) -> bool:
        """True when ``after_attention`` needs the exact attention row of the decode query."""
        return False

    @property
    def needs_prefill_column_sums(self) -> bool:
        """True when ``after_attention`` scores with the attention every prompt query gives each key:
        the runtime's prefill attention then sums it in the same pass (``call.column_sums``)."""
        return False

    @property
    def narrows_prefill(self) -> bool:
        """True when the prefill runs on fewer tokens from some layer on: the runtime then asks
        :meth:`prefill_rows` before each decoder layer."""
        return False

    @property
    def selects_visual_tokens(self) -> bool:
        """True when the method chooses each image's tokens before the decoder: the runtime then
        calls :meth:`select_visual` with what the vision tower computed (a model whose tower cannot
        provide it is refused)."""
        return False

    def media_scale(self) -> float:
        """The share of the visual tokens the model's processor would make of each picture and video
        frame that the runtime is to make instead, by resizing the media before the vision tower
        (``resizes_media`` methods; 1.0: the media as the processor sizes them)."""
        return 1.0

    @property
    def config(self) -> dict[str, Any]:
        """The parameters' values by name (``budget`` aside)."""
        return {p.name: getattr(self, p.name) for p in self.param_specs()}

    # --- seams -------------------------------------------------------------------------------
    def new_layer(self, layer_idx: int) -> KVLayer:
        return KVLayer()

    def attend(self, call: AttentionCall, query, key, value, scaling: float) -> torch.Tensor | None:
        return None

    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        """``attn_row``: (H, 1, S) float32 softmax of the decode query if ``needs_decode_attention``."""

    def prefill_rows(self, call: AttentionCall) -> torch.Tensor | None:
        """Before decoder layer ``call.layer_idx`` of a prefill (``narrows_prefill`` only): the
        (q',) ascending indices, among the ``call.positions`` still going, of the rows this layer
        and the later ones run on; None keeps them all. ``call.hidden`` holds what those rows carry
        into the layer."""
        return None

    def select_visual(self, tokens: VisionTokens) -> torch.Tensor:
        """``selects_visual_tokens`` only: the (B, N, C) features the projector is to read instead of
        ``tokens.features``, called once per forward pass with images, before the decoder runs."""
        return tokens.features

    def before_forward(self, cache, call: AttentionCall) -> None:
        """A forward pass starts; nothing taken here may outlive it (see the module's docstring)."""

    def after_forward(self, cache, call: AttentionCall) -> None:
        pass

    # --- helpers for subclasses ---------------------------------------------------------------
    def reset_report(self) -> Report:
        """Start a fresh, empty report (e.g. before a prompt whose report must not show the last one's)."""
        self.report = self.report_type()
        return self.report

    def budget_tokens(self, total: int, minimum: int = 1) -> int:
        """Tokens kept out of ``total`` at this budget (rounded, never below ``minimum``)."""
        return min(total, max(minimum, math.ceil(self.budget * total - 1e-9)))
