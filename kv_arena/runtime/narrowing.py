"""A prefill that runs on fewer tokens from some decoder layer on, for a method that
``narrows_prefill`` (FastV): PyTorch forward pre-hooks on the decoder layers, nothing patched.

Before each layer the method's ``prefill_rows(call)`` (``call.hidden``: the hidden states entering the
layer) may hand over the rows that go on; the hook
then shortens the hidden states, the rotary tables (the model computes them once, for every new
token, and hands the same ones to every layer) and the text position ids to the rows still going,
and narrows the forward pass (:meth:`ForwardRun.narrow`), so the cache of this layer and of every
later one receives the kept tokens' keys at their original positions. The decoder's output then
has the kept rows only; the last prompt token, whose logits the runtime reads, must be among them.

DeepStack (Qwen3-VL) adds visual features to the hidden states after the first layers, by a mask
over every new token: once rows are dropped that mask no longer fits, so while a narrowing method
runs the features are taken out of the decoder's inputs and added here instead, after each layer,
to the rows still going (zero on text rows, so nothing changes where nothing was dropped).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from .attention import active_run


class _Narrowing:
    """The hooks' shared state for one decoder: the rows still going in the pass now running."""

    def __init__(self) -> None:
        self.kept: torch.Tensor | None = None  # indices among the pass's new tokens, None: all
        self.deepstack: torch.Tensor | None = None  # (layers, q, hidden) features, zero on text rows

    def before_decoder(self, module, args, kwargs):
        self.kept, self.deepstack = None, None
        features = kwargs.get("deepstack_visual_embeds")
        if features is None:
            return None
        embeds = kwargs["inputs_embeds"]
        mask = kwargs["visual_pos_masks"][0].to(embeds.device)
        dense = embeds.new_zeros(len(features), embeds.shape[1], embeds.shape[2])
        dense[:, mask] = torch.stack(list(features)).to(embeds.device, embeds.dtype)
        self.deepstack = dense
        return args, kwargs | {"deepstack_visual_embeds": None, "visual_pos_masks": None}

    def before_layer(self, index: int):
        def hook(module, args, kwargs):
            run = active_run()
            if run is None or not run.call.is_prefill:
                return None
            hidden = args[0]
            call = replace(run.call_for(index), hidden=hidden)  # what the rows carry into this layer
            rows = run.timed(run.cache.backend.prefill_rows, call)
            if rows is not None:
                rows = rows.to(hidden.device)
                hidden = hidden[:, rows]
                self.kept = rows if self.kept is None else self.kept[rows]
                run.narrow(rows)
            if self.kept is None:
                return None
            cos, sin = kwargs["position_embeddings"]
            kwargs["position_embeddings"] = (cos[:, self.kept], sin[:, self.kept])
            ids = kwargs.get("position_ids")
            if ids is not None and ids.shape[-1] == cos.shape[1]:
                kwargs["position_ids"] = ids[..., self.kept]
            return (hidden, *args[1:]), kwargs
        return hook

    def after_layer(self, index: int):
        def hook(module, args, output):
            if self.deepstack is None or index >= len(self.deepstack):
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            features = self.deepstack[index] if self.kept is None else self.deepstack[index][self.kept]
            hidden = hidden + features[None].to(hidden.dtype)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return hook


@contextmanager
def narrowing(model, backend):
    """While the block runs, ``model``'s decoder layers run on the rows ``backend`` keeps (only
    when it ``narrows_prefill``; any other method runs untouched, with no hook installed)."""
    if not backend.narrows_prefill:
        yield
        return
    decoder = model.get_decoder()
    state = _Narrowing()
    handles = [decoder.register_forward_pre_hook(state.before_decoder, with_kwargs=True)]
    for i, layer in enumerate(decoder.layers):
        handles.append(layer.register_forward_pre_hook(state.before_layer(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(state.after_layer(i)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
