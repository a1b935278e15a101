"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
Sec. 3.2): keep the first few tokens (attention sinks) and a window of the most recent tokens.

Budget semantics: the cache holds ``budget x tokens seen`` entries during prefill and decoding
(sinks included), so the saving stays constant as the answer grows. Positions are already baked
into the cached keys (post-RoPE) and the runtime keeps feeding true positions, which is the
"position within the original text" variant; the paper's cache-relative re-rotation is not needed
for a model that was never trained to stream past its context.

Streamed prefill under a byte cap (a long video fed a few frames at a time): after every chunk
each layer keeps the sinks and the most recent entries that fit its equal share of the cap, the
paper's rolling cache with a byte-sized window. Query-agnostic: what stays depends only on where
a token sits.
"""

from dataclasses import dataclass

import torch

from .base import KVBackend
from .params import param


@dataclass(eq=False)
class StreamingLLM(KVBackend):
    name = "streamingllm"
    title = "StreamingLLM"
    does = "drops"
    chooses_tokens = True
    paper = "https://arxiv.org/abs/2309.17453"
    summary = "Keeps the first tokens (attention sinks) and the most recent ones; drops the middle, images included."
    sink_tokens: int = param(4, "How many of the very first tokens are always kept (the 'attention sinks').", 0, 64, 1)
    holds_budget_while_decoding = True
    streams_under_cap = True  # sinks and the newest tokens: query-agnostic, whatever the stream holds

    def after_forward(self, cache, call) -> None:
        budget_count = self.budget_tokens(call.seen, minimum=self.sink_tokens + 1)
        for layer in cache.layers:
            cap = call.cap_entries(layer)  # a streamed prefill's cap, if lower
            keep_count = budget_count if cap is None else min(budget_count, max(cap, self.sink_tokens + 1))
            held = layer.get_seq_length()
            if held <= keep_count:
                continue
            sinks = min(self.sink_tokens, keep_count)
            index = torch.cat([torch.arange(sinks), torch.arange(held - (keep_count - sinks), held)])
            layer.keep(index)
