"""Visual tokens chosen before the decoder, for a method that ``selects_visual_tokens`` (VisionZip):
PyTorch forward hooks on the vision tower and the projector, nothing patched.

LLaVA-1.5 (transformers' Llava with a CLIP tower, one feature layer, CLS dropped before the
projector): hooks on the query and key projections of the tower layer the projector reads keep the
CLS token's query and every token's key as the tower computes them (no second pass); a pre-hook on
the projector hands those and the patch features to the method (:class:`~backends.base.VisionTokens`)
and projects what it returns. The method then drops the other rows before the first decoder layer
(``prefill_rows``, through ``kv_arena.runtime.narrowing``), so the placeholders, the layout and
transformers' own checks see every image token.

Any other model is refused in one line (:func:`refusal`): Qwen-VL towers have no CLS token and
attend within windows, SigLIP (LLaVA-OneVision) has no CLS token, LLaVA-NeXT tiles an image.

The same refusal covers a method that shrinks the media before the tower (``resizes_media``:
Downsample) on a model whose processor sizes every picture to a fixed grid (the LLaVA family), where
a smaller picture makes as many visual tokens (the chat adapter's ``resizable``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kv_arena.backends.base import KVBackend, VisionTokens

from ..errors import UserError
from .attention import active_run
from .inputs import ADAPTERS


def _tower_index(config) -> int | None:
    """The index of the CLIP encoder layer whose output the projector reads, from the model's config
    alone (no weights), or None where there is no such one."""
    if config.model_type != "llava" or getattr(config.vision_config, "model_type", "") != "clip_vision_model":
        return None
    if not isinstance(config.vision_feature_layer, int) or config.vision_feature_select_strategy != "default":
        return None
    # hidden_states[k] is the output of encoder layer k - 1, the embeddings being hidden_states[0]
    index = config.vision_feature_layer % (config.vision_config.num_hidden_layers + 1) - 1
    return index if index >= 0 else None


def _tower_layer(model):
    """The CLIP encoder layer whose output the projector reads, or None where there is no such one."""
    index = _tower_index(model.config)
    if index is None:
        return None
    tower = model.model.vision_tower
    layers = getattr(tower, "vision_model", tower).encoder.layers  # CLIPVisionModel wraps it before transformers 5
    return layers[index] if index < len(layers) else None


def _why(backend, family: str, advice: bool = True) -> str:
    why = (f"{backend.title} ranks an image's tokens by the CLS token's attention in a CLIP vision tower (LLaVA-1.5); "
           f"this {family} model's tower has none it can read")
    return why + (f": pick another method, or {backend.title} at keep 1.0." if advice else ".")


def _fixed_grid(config) -> bool:
    """Whether the model's processor sizes every picture to one grid, whatever its size."""
    adapter = ADAPTERS.get(config.model_type)
    return adapter is None or not adapter.resizable


def _why_not_resized(backend, family: str, advice: bool = True) -> str:
    why = (f"{backend.title} shrinks a picture so that it makes fewer visual tokens; this {family} model's processor "
           "sizes every picture to a fixed grid, so a smaller one makes as many")
    return why + (f": pick another method, or {backend.title} at budget 1.0." if advice else ".")


def refusal(model, backend: KVBackend) -> str | None:
    """Why ``backend`` cannot run on ``model`` (one line), or None where it can."""
    if backend.media_scale() < 1 and _fixed_grid(model.config):
        return _why_not_resized(backend, model.config.model_type)
    if not backend.selects_visual_tokens or _tower_layer(model) is not None:
        return None
    return _why(backend, model.config.model_type)


def config_refusal(config, backend: KVBackend) -> str | None:
    """Why ``backend`` cannot run on a model, from its config alone (no weights loaded), without
    :func:`refusal`'s advice (a picker that does not offer the method says this), or None."""
    if type(backend).resizes_media and _fixed_grid(config):  # whatever its budget: the picker leaves it out
        return _why_not_resized(backend, config.model_type, advice=False)
    if not backend.selects_visual_tokens or _tower_index(config) is not None:
        return None
    return _why(backend, config.model_type, advice=False)


def check_runs_on(model, backend: KVBackend) -> None:
    """Raise a one-line UserError if ``backend`` cannot run on ``model``."""
    reason = refusal(model, backend)
    if reason is not None:
        raise UserError(reason)


class _Capture:
    """The CLS query and the keys of the tower layer, from its projections' outputs."""

    def __init__(self, attention) -> None:
        self.attention = attention
        self.query: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None

    def heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(B, T, H*D) -> (B, H, T, D)."""
        b, t, _ = projected.shape
        return projected.view(b, t, -1, self.attention.head_dim).transpose(1, 2)

    def on_query(self, module, args, output) -> None:
        self.query = self.heads(output[:, :1])[:, :, 0]

    def on_keys(self, module, args, output) -> None:
        self.keys = self.heads(output)


@contextmanager
def selecting_visual_tokens(model, backend: KVBackend):
    """While the block runs, the images ``model`` encodes reach its projector as ``backend`` chose
    them (only when it ``selects_visual_tokens``; otherwise no hook is installed). A model that
    cannot give what it reads is refused (UserError) before anything runs."""
    if not backend.selects_visual_tokens:
        yield
        return
    check_runs_on(model, backend)
    attention = _tower_layer(model).self_attn
    capture = _Capture(attention)

    def before_projector(module, args):
        if capture.keys is None:
            return None
        tokens = VisionTokens(args[0], capture.query, capture.keys, attention.scale)
        capture.query = capture.keys = None
        run = active_run()  # the app's runtime times it as the method's work (kv_arena.hf has no pass open yet)
        chosen = backend.select_visual(tokens) if run is None else run.timed(backend.select_visual, tokens)
        return (chosen, *args[1:])

    handles = [attention.q_proj.register_forward_hook(capture.on_query),
               attention.k_proj.register_forward_hook(capture.on_keys),
               model.model.multi_modal_projector.register_forward_pre_hook(before_projector)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
