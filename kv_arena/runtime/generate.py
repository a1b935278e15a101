"""A conversation with one model and one KV method: prefill, streaming decode, multi-turn, meters.

Batch 1. The loop calls the model directly with explicit rotary positions, so positions stay
right whatever the cache evicted or merged (1-D RoPE and M-RoPE alike), and the clocks sit
where tokens are produced.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import torch

from kv_arena.backends.base import AttentionCall, KVBackend
from kv_arena.backends.layout import PromptLayout
from kv_arena.backends.media_reuse import ReusesMedia

from ..errors import UserError
from .cache import KVCache
from .forward import rotary_of, run_forward
from .inputs import DEFAULT_SYSTEM, Chunk, Message
from .models import LoadedModel
from .vision_tokens import check_runs_on


def agreement(a: list[int], b: list[int], ignore: frozenset[int] | set[int] = frozenset()) -> float:
    """Share of positions where two answers have the same token (over the longer answer). Tokens in
    ``ignore`` (an end-of-turn) are left out first: two wrong one-word answers that both end do not
    half agree."""
    a, b = [t for t in a if t not in ignore], [t for t in b if t not in ignore]
    longest = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / longest if longest else 1.0


def answer_words(text: str) -> list[str]:
    """An answer's words as answers are compared: lower case, punctuation dropped."""
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def loyal(text: str, reference: str) -> bool:
    """Whether an answer is the full cache's answer ``reference``, whole (:func:`answer_words`, word for
    word), right or wrong: what a method's **loyalty** (the share of its answers that are) counts.
    :func:`agreement` is the softer figure: the share of positions with the same token."""
    return answer_words(text) == answer_words(reference)


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


@dataclass
class ConversationState:
    """A conversation without its model: its method, cache and counters (:meth:`Conversation.snapshot`).
    It pickles without weights, so it can cross processes (a ZeroGPU worker hands it back);
    :meth:`Conversation.restore` continues it on a loaded model."""

    backend: KVBackend
    cache: KVCache
    system_prompt: str | None
    seen: int
    next_position: int
    pending: list[int]
    turn_open: bool
    layouts: list[PromptLayout]
    steps: int
    last_logits: torch.Tensor | None
    linked: bool  # it had a linker (stored media KV): restore it with one


class Conversation:
    """Multi-turn chat whose (compressed) cache is carried from turn to turn."""

    def __init__(self, loaded: LoadedModel, backend: KVBackend, system_prompt: str | None = DEFAULT_SYSTEM,
                 linker=None, cache: KVCache | None = None):
        check_runs_on(loaded.model, backend)  # a method the model's vision tower cannot serve: one line, now
        self.loaded = loaded
        self.backend = backend
        # kv_arena.mpic.linking.Linker: stored media KV, for a backend that reuses it (backends.media_reuse.ReusesMedia)
        self.linker = linker
        # ``cache``: the backend's own, when a conversation is restored (a backend may track its layers)
        self.cache = KVCache(backend, loaded.num_layers) if cache is None else cache
        self.system_prompt = system_prompt
        self.seen = 0  # tokens fed so far (the uncompressed history length)
        self.next_position = 0  # rotary position of the next token
        self.pending: list[int] = []  # generated ids not yet fed (the end of the last answer)
        self.turn_open = False  # a user turn was started without its closing (question-after mode)
        self.layouts: list[PromptLayout] = []
        self.steps = 0
        self.last_logits: torch.Tensor | None = None  # float32 logits after the last token fed (the next token's)

    @property
    def adapter(self):
        return self.loaded.adapter

    # --- its state, without the model ------------------------------------------------------------
    def snapshot(self) -> ConversationState:
        """The method, cache and counters, sharing their objects (nothing is copied)."""
        return ConversationState(self.backend, self.cache, self.system_prompt, self.seen, self.next_position,
                                 self.pending, self.turn_open, self.layouts, self.steps, self.last_logits,
                                 linked=self.linker is not None)

    @classmethod
    def restore(cls, state: ConversationState, loaded: LoadedModel, linker=None) -> Conversation:
        """The conversation ``state`` was taken from, continued on ``loaded`` (with ``linker`` when
        ``state.linked``)."""
        conv = cls(loaded, state.backend, state.system_prompt, linker, cache=state.cache)
        conv.seen, conv.next_position, conv.pending = state.seen, state.next_position, state.pending
        conv.turn_open, conv.layouts, conv.steps, conv.last_logits = state.turn_open, state.layouts, state.steps, state.last_logits
        return conv

    # --- positions -----------------------------------------------------------------------------
    def rotary(self, rope_ids: torch.Tensor):
        """(P, n) rotary ids -> (cos, sin) of shape (1, n, D), as the model computes them."""
        return rotary_of(self.loaded.language_model())(rope_ids)

    # --- one forward pass ----------------------------------------------------------------------
    def forward(self, input_ids, rope_ids, layout: PromptLayout | None, model_kwargs: dict,
                positions: torch.Tensor | None = None, seen: int | None = None,
                cap_bytes: int | None = None) -> tuple[torch.Tensor, float]:
        """One forward pass of new tokens on the cache: (float32 logits of the last one, seconds in
        the method's hooks). ``positions`` / ``seen`` (token indices fed, history length after) let a
        linked prefill feed a subset of a chunk; ``input_ids`` is None when ``model_kwargs`` holds
        ``inputs_embeds``; ``cap_bytes``: a streamed prefill's memory cap, handed to the method."""
        q = rope_ids.shape[1]
        if positions is None:
            positions = torch.arange(self.seen, self.seen + q, device=self.loaded.device)
        seen = self.seen + q if seen is None else seen
        call = AttentionCall(layer_idx=0, num_layers=self.loaded.num_layers, phase="prefill" if q > 1 else "decode",
                             positions=positions, rope_ids=rope_ids, layout=layout, seen=seen,
                             step=self.steps, rotary=self.rotary, cap_bytes=cap_bytes)
        dev = self.loaded.device
        out, run = run_forward(self.loaded.model, self.cache, call, sync=self.cuda,
                               input_ids=None if input_ids is None else input_ids.to(dev), logits_to_keep=1,
                               **self.loaded.on_device(model_kwargs))
        self.seen = seen
        return out.logits[0, -1].float(), run.settle()

    def rewind(self, seen: int) -> None:
        """Back to ``seen`` tokens fed, after a prefill abandoned half-way (its method already
        dropped what that prefill had put in the cache)."""
        self.seen = seen

    # --- a prompt fed in parts (kv_arena.runtime.streaming) --------------------------------------
    def encode(self, message: Message, close_turn: bool = False) -> Chunk:
        """The next part of the conversation's prompt for ``message``, placed after what was fed
        (system prompt on the first turn, the last answer's unfed end, the user header if no turn
        is open), without feeding it."""
        if self.linker is not None:  # decode the media once and note their content keys
            message = self.linker.resolve(message)
        prefix = list(self.pending)
        system = self.system_prompt if self.seen == 0 and not prefix else None
        return self.adapter.encode_turn(message, self.seen, self.next_position, system, prefix,
                                        open_turn=not self.turn_open, close_turn=close_turn,
                                        media_scale=self.backend.media_scale())  # Downsample: smaller media

    @torch.inference_mode()
    def prefill_chunk(self, chunk: Chunk, cap_bytes: int | None = None) -> float:
        """Prefill one part of a prompt on top of the cache (a streamed video's next frames), with
        the rotary positions ``chunk`` carries; ``cap_bytes`` asks the method to hold the whole cache
        under that many bytes once the part is in. Returns the seconds spent in the method's hooks."""
        logits, overhead = self.forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs,
                                        cap_bytes=cap_bytes)
        self.next_position = chunk.next_position
        self.pending = []
        self.layouts.append(chunk.layout)
        self.last_logits = logits
        return overhead

    # --- turns ---------------------------------------------------------------------------------
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
        chunk = self.encode(message, close_turn=False)
        self._check_length(chunk, 0)
        metrics = self._prefill(chunk, start)
        self.turn_open = True
        return metrics

    def _prefill(self, chunk: Chunk, start: float) -> Metrics:
        m = Metrics(prompt_tokens=chunk.input_ids.shape[1],
                    visual_tokens=sum(v.length for v in chunk.layout.visuals))
        t0 = self._clock()
        if self.linker is not None and isinstance(self.backend, ReusesMedia):
            logits, overhead = self.linker.prefill(self, chunk)
        else:
            logits, overhead = self.forward(chunk.input_ids, chunk.rope_ids, chunk.layout, chunk.model_kwargs)
        m.prefill_s = self._clock() - t0
        m.overhead_s = overhead
        self.next_position = chunk.next_position
        self.pending = []
        self.layouts.append(chunk.layout)
        m.kv_bytes_prefill = m.kv_bytes = self.cache.nbytes()
        m.kv_trace.append(m.kv_bytes)
        m.tokens_held = self.cache.tokens_per_layer()
        self.last_logits = logits
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
        m = self._open_turn(message, max_new_tokens, question_after, start)
        generator = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        text = ""
        logits = self.last_logits
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
            logits = self._feed_token(token, m)
        self._close_turn(ids, m)
        yield Update(text, delta, list(ids), m, done=True)

    @torch.inference_mode()
    def replay(self, message: Message, token_ids: list[int], question_after: bool = False) -> Metrics:
        """An earlier turn read again: ``message`` prefilled as :meth:`stream` prefills it, then its
        answer ``token_ids`` fed one by one as its decode steps fed them (teacher-forced, nothing
        sampled). A conversation switched to another method re-reads the turns so far this way and
        holds what that method would have held had it been used from the start with these answers."""
        if not token_ids:
            raise ValueError("replay needs the answer's token ids (at least one)")
        m = self._open_turn(message, len(token_ids), question_after, time.perf_counter())
        for token in token_ids[:-1]:
            self._feed_token(token, m)
        m.new_tokens = len(token_ids)
        self._close_turn(list(token_ids), m)
        return m

    def _open_turn(self, message: Message, max_new_tokens: int, question_after: bool, start: float) -> Metrics:
        """Prefill a user turn (in two parts with ``question_after``): the metrics of its prompt."""
        if not message.text.strip() and not message.images and not message.videos:
            raise UserError("The message is empty: type a question or attach an image or a video.")
        setup = None
        if question_after and message.text.strip() and (message.images or message.videos):
            setup = self.feed(replace(message, text=""))
            message = replace(message, images=[], videos=[])
        chunk = self.encode(message, close_turn=True)
        self._check_length(chunk, max_new_tokens)
        m = self._prefill(chunk, start)
        if setup is not None:
            m.prompt_tokens += setup.prompt_tokens
            m.visual_tokens += setup.visual_tokens
            m.prefill_s += setup.prefill_s
            m.overhead_s += setup.overhead_s
        self.turn_open = False
        return m

    def _feed_token(self, token: int, m: Metrics) -> torch.Tensor:
        """One decode step: ``token`` on the cache, timed into ``m``; the next token's logits."""
        t0 = self._clock()
        self.steps += 1
        logits, overhead = self.forward(torch.tensor([[token]]), torch.tensor([[self.next_position]] * self.adapter.rope_dims),
                                        None, {})
        m.step_s.append(self._clock() - t0)
        m.decode_s += m.step_s[-1]
        m.decode_overhead_s += overhead
        self.next_position += 1
        m.kv_bytes = self.cache.nbytes()
        m.kv_trace.append(m.kv_bytes)
        return logits

    def _close_turn(self, ids: list[int], m: Metrics) -> None:
        """The answer's last token is not fed yet: it (and an end-of-turn if missing) opens the next turn."""
        last = ids[-1]
        self.pending = [last] + (self.adapter.tokens(self.adapter.assistant_close) if last in self.adapter.eos_ids
                                 else self.adapter.end_of_turn_ids())
        m.tokens_held = self.cache.tokens_per_layer()
        if self.cuda:
            m.peak_memory_bytes = torch.cuda.max_memory_allocated()

    def ask(self, message: Message, **kwargs) -> Update:
        """Run ``stream`` to the end and return its last update."""
        last = None
        for last in self.stream(message, **kwargs):
            pass
        return last

    # --- helpers -------------------------------------------------------------------------------
    @property
    def cuda(self) -> bool:
        return self.loaded.device.type == "cuda"

    def _clock(self) -> float:
        if self.cuda:
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
