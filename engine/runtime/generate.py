"""A conversation with one model and one KV method: prefill, streaming decode, multi-turn, meters.

Batch 1. The loop calls the model directly with explicit rotary positions, so positions stay
right whatever the cache evicted or merged (1-D RoPE and M-RoPE alike), and the clocks sit
where tokens are produced.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import torch

from backends.base import AttentionCall, KVBackend
from backends.layout import PromptLayout

from ..errors import UserError
from .attention import ForwardRun, forward_run
from .cache import KVCache
from .inputs import DEFAULT_SYSTEM, Chunk, Message
from .models import LoadedModel


def agreement(a: list[int], b: list[int], ignore: frozenset[int] | set[int] = frozenset()) -> float:
    """Share of positions where two answers have the same token (over the longer answer). Tokens in
    ``ignore`` (an end-of-turn) are left out first: two wrong one-word answers that both end do not
    half agree."""
    a, b = [t for t in a if t not in ignore], [t for t in b if t not in ignore]
    longest = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / longest if longest else 1.0


@dataclass
class Metrics:
    """Figures of one request (one user turn), all measured, none estimated."""

    prompt_tokens: int = 0
    visual_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # request -> first token: media encoding, prefill, method overhead
    prefill_s: float = 0.0  # forward passes of the prompt (vision encoder included)
    overhead_s: float = 0.0  # time inside the method's hooks (scoring, compressing) during prefill
    decode_s: float = 0.0
    decode_overhead_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # latency of each decode step
    kv_bytes_prefill: int = 0  # held after prefill and compression
    kv_bytes: int = 0  # held now
    kv_trace: list[int] = field(default_factory=list)  # held after prefill, then after every step
    tokens_held: list[int] = field(default_factory=list)  # per layer, now
    peak_memory_bytes: int | None = None  # CUDA only

    @property
    def decode_tok_s(self) -> float:
        return len(self.step_s) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["decode_tok_s"] = self.decode_tok_s
        return data


@dataclass
class Update:
    """One streamed event: the answer so far and the meters at this point."""

    text: str
    delta: str
    token_ids: list[int]
    metrics: Metrics
    done: bool = False


class Conversation:
    """Multi-turn chat whose (compressed) cache is carried from turn to turn."""

    def __init__(self, loaded: LoadedModel, backend: KVBackend, system_prompt: str | None = DEFAULT_SYSTEM,
                 linker=None):
        self.loaded = loaded
        self.backend = backend
        self.linker = linker  # engine.mpic.linking.Linker: stored media KV for backends that reuse it (MPIC)
        self.adapter = loaded.adapter
        self.cache = KVCache(backend, loaded.num_layers)
        self.system_prompt = system_prompt
        self.seen = 0  # tokens fed so far (the uncompressed history length)
        self.next_position = 0  # rotary position of the next token
        self.pending: list[int] = []  # generated ids not yet fed (the end of the last answer)
        self.turn_open = False  # a user turn was started without its closing (question-after mode)
        self.layouts: list[PromptLayout] = []
        self.steps = 0
        self._sync = loaded.device.type == "cuda"
        lm = loaded.language_model()
        self._rotary_module = lm.rotary_emb

    # --- positions -----------------------------------------------------------------------------
    def _position_ids(self, rope_ids: torch.Tensor) -> torch.Tensor:
        rope_ids = rope_ids.to(self.loaded.device)
        return rope_ids[:, None, :] if self.adapter.rope_dims == 3 else rope_ids

    def rotary(self, rope_ids: torch.Tensor):
        """(P, n) rotary ids -> (cos, sin) of shape (1, n, D), as the model computes them."""
        dummy = torch.zeros(1, dtype=self.loaded.dtype, device=self.loaded.device)
        return self._rotary_module(dummy, self._position_ids(rope_ids))

    # --- one forward pass ----------------------------------------------------------------------
    def _forward(self, input_ids, rope_ids, layout: PromptLayout | None, model_kwargs: dict,
                 positions: torch.Tensor | None = None, seen: int | None = None,
                 cap_bytes: int | None = None) -> tuple[torch.Tensor, float]:
        """One forward pass. ``positions`` / ``seen`` (token indices fed, history length after) let a
        linked prefill feed a subset of a chunk; ``input_ids`` is None when ``model_kwargs`` holds
        ``inputs_embeds``; ``cap_bytes``: a streamed prefill's memory cap, handed to the method."""
        q = rope_ids.shape[1]
        if positions is None:
            positions = torch.arange(self.seen, self.seen + q, device=self.loaded.device)
        seen = self.seen + q if seen is None else seen
        self.cache.pending_positions = positions
        call = AttentionCall(layer_idx=0, num_layers=self.loaded.num_layers, phase="prefill" if q > 1 else "decode",
                             positions=positions, rope_ids=rope_ids, layout=layout, seen=seen,
                             step=self.steps, rotary=self.rotary, cap_bytes=cap_bytes)
        run = ForwardRun(self.cache, call, sync=self._sync)
        dev = self.loaded.device
        kwargs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in model_kwargs.items()}
        if "pixel_values" in kwargs and kwargs["pixel_values"].is_floating_point():
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.loaded.dtype)
        with forward_run(run):
            out = self.loaded.model(input_ids=None if input_ids is None else input_ids.to(dev),
                                    position_ids=self._position_ids(rope_ids),
                                    past_key_values=self.cache, use_cache=True, logits_to_keep=1, **kwargs)
            run.timed(self.backend.after_forward, self.cache, call)
        self.seen = seen
        return out.logits[0, -1].float(), run.settle()

    # --- a prompt fed in parts (engine.runtime.streaming) --------------------------------------
    def encode(self, message: Message, close_turn: bool = False) -> Chunk:
        """The next part of the conversation's prompt for ``message``, placed after what was fed
        (system prompt on the first turn, the last answer's unfed end, the user header if no turn
        is open), without feeding it."""
        return self._encode(message, close_turn)

    @torch.inference_mode()
    def prefill_chunk(self, chunk: Chunk, cap_bytes: int | None = None) -> float:
        """Prefill one part of a prompt on top of the cache (a streamed video's next frames), with
        the rotary positions ``chunk`` carries; ``cap_bytes`` asks the method to hold the whole cache
        under that many bytes once the part is in. Returns the seconds spent in the method's hooks."""
        logits, overhead = self._forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs,
                                         cap_bytes=cap_bytes)
        self.next_position = chunk.next_position
        self.pending = []
        self.layouts.append(chunk.layout)
        self._last_logits = logits
        return overhead

    @property
    def last_logits(self) -> torch.Tensor | None:
        """Float32 logits after the last token fed (the next token's distribution)."""
        return getattr(self, "_last_logits", None)

    # --- turns ---------------------------------------------------------------------------------
    def _encode(self, message: Message, close_turn: bool) -> Chunk:
        if self.linker is not None:  # decode the media once and note their content keys
            message = self.linker.resolve(message)
        prefix = list(self.pending)
        system = self.system_prompt if self.seen == 0 and not prefix else None
        return self.adapter.encode_turn(message, self.seen, self.next_position, system, prefix,
                                        open_turn=not self.turn_open, close_turn=close_turn)

    def _check_length(self, chunk: Chunk, max_new_tokens: int) -> None:
        needed = self.next_position + chunk.input_ids.shape[1] + max_new_tokens
        if needed > self.loaded.max_context:
            raise UserError(f"The prompt is too long: {self.seen + chunk.input_ids.shape[1]} tokens plus "
                            f"{max_new_tokens} new ones exceed the model's context of {self.loaded.max_context}. "
                            "Use fewer images or frames, or start a new chat.")

    @torch.inference_mode()
    def feed(self, message: Message) -> Metrics:
        """Prefill a partial user turn (media, text before the question) and compress it, without
        answering: the question then arrives on top of the compressed cache (``question_after``)."""
        start = time.perf_counter()
        chunk = self._encode(message, close_turn=False)
        self._check_length(chunk, 0)
        metrics = self._prefill(chunk, start)
        self.turn_open = True
        return metrics

    def _prefill(self, chunk: Chunk, start: float) -> Metrics:
        m = Metrics(prompt_tokens=chunk.input_ids.shape[1],
                    visual_tokens=sum(v.length for v in chunk.layout.visuals))
        t0 = self._clock()
        if self.linker is not None:
            logits, overhead = self.linker.prefill(self, chunk)
        else:
            logits, overhead = self._forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs)
        m.prefill_s = self._clock() - t0
        m.overhead_s = overhead
        self.next_position = chunk.next_position
        self.pending = []
        self.layouts.append(chunk.layout)
        m.kv_bytes_prefill = m.kv_bytes = self.cache.nbytes()
        m.kv_trace.append(m.kv_bytes)
        m.tokens_held = self.cache.tokens_per_layer()
        self._last_logits = logits
        return m

    @torch.inference_mode()
    def stream(self, message: Message, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, should_stop=None, ignore_eos: bool = False,
               question_after: bool = False) -> Iterator[Update]:
        """Answer one user turn, yielding after every token. ``should_stop()`` ends it early;
        ``ignore_eos`` generates exactly ``max_new_tokens`` (benchmarks on random weights).
        ``question_after``: a message with media and a question is fed in two prefills, the media
        first (compressed by the method as it would be cached, before any question is known:
        :meth:`feed`), then the question on top of the compressed cache; the metrics count both
        (TTFT from the start of the first)."""
        start = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        if not message.text.strip() and not message.images and not message.videos:
            raise UserError("The message is empty: type a question or attach an image or a video.")
        setup = None
        if question_after and message.text.strip() and (message.images or message.videos):
            setup = self.feed(replace(message, text=""))
            message = replace(message, images=[], videos=[])
        chunk = self._encode(message, close_turn=True)
        self._check_length(chunk, max_new_tokens)
        m = self._prefill(chunk, start)
        if setup is not None:
            m.prompt_tokens += setup.prompt_tokens
            m.visual_tokens += setup.visual_tokens
            m.prefill_s += setup.prefill_s
            m.overhead_s += setup.overhead_s
        self.turn_open = False
        generator = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        text = ""
        logits = self._last_logits
        eos = set() if ignore_eos else self.adapter.eos_ids
        for step in range(max_new_tokens):
            token = self._sample(logits, temperature, top_p, generator)
            ids.append(token)
            if step == 0:
                m.ttft_s = self._clock() - start
            new_text = self.adapter.tokenizer.decode(ids, skip_special_tokens=True)
            delta, text = (new_text[len(text):], new_text) if not new_text.endswith("\ufffd") else ("", text)
            m.new_tokens = len(ids)
            finished = token in eos or step == max_new_tokens - 1 or (should_stop is not None and should_stop())
            if finished:
                break
            yield Update(text, delta, list(ids), m)
            t0 = self._clock()
            self.steps += 1
            logits, overhead = self._forward(torch.tensor([[token]]), torch.tensor([[self.next_position]] * self.adapter.rope_dims),
                                             None, {})
            m.step_s.append(self._clock() - t0)
            m.decode_s += m.step_s[-1]
            m.decode_overhead_s += overhead
            self.next_position += 1
            m.kv_bytes = self.cache.nbytes()
            m.kv_trace.append(m.kv_bytes)
        # the last token is not fed yet: it (and an end-of-turn if missing) opens the next turn
        last = ids[-1]
        self.pending = [last] + (self.adapter.tokens(self.adapter.assistant_close) if last in self.adapter.eos_ids
                                 else self.adapter.end_of_turn_ids())
        m.tokens_held = self.cache.tokens_per_layer()
        if self.cuda:
            m.peak_memory_bytes = torch.cuda.max_memory_allocated()
        yield Update(text, delta, list(ids), m, done=True)

    def ask(self, message: Message, **kwargs) -> Update:
        """Run ``stream`` to the end and return its last update."""
        last = None
        for last in self.stream(message, **kwargs):
            pass
        return last

    # --- helpers -------------------------------------------------------------------------------
    @property
    def cuda(self) -> bool:
        return self._sync

    def _clock(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        probs = (logits / temperature).softmax(-1).cpu()
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cut = sorted_probs.cumsum(-1) - sorted_probs > top_p
            sorted_probs[cut] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
