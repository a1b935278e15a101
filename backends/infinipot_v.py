"""InfiniPot-V (Kim, Shim, Choi and Chang, "InfiniPot-V: Memory-Constrained KV Cache Compression for
Streaming Video Understanding", NeurIPS 2025, arXiv 2506.15745, Sec. 3): while a video streams in,
compress its cache in place each time it reaches a memory threshold |M|, down to a target |C|,
without the question (query-agnostic, training-free). Two scores pick the video tokens kept:

* TaR, temporal-axis redundancy: the newest frames are the reference; a past token whose key is
  like the keys at the *same spatial place* in those frames (a static patch) is redundant. Its
  score is minus the mean cosine similarity of its key to theirs, per KV head; the recent frames
  are kept whole, and with the past tokens of highest TaR they fill ``tar_ratio`` of the *video*
  entries a compression keeps (|C| less the entries never evicted, below).
* VaN, value norm: the L2 norm of a token's value vector marks the semantically salient tokens;
  the rest of the video entries kept go to the largest norms, per KV head, among those TaR left.

``tar_ratio`` is a share of the video tokens kept, not of all of |C| (which here counts the text
too): the authors' code gives TaR ``compress_frame_num x token_per_frame`` video tokens (the system
prompt is kept beside them) less VaN's ``round((1 - tar_ratio) x`` that ``)``, and the paper
compresses video tokens only, its |C| being the compressed video cache. :func:`tar_share` rounds
as the code does.

Schedule: the runtime's streamed prefill (``AttentionCall.cap_bytes``) gives |M|: each layer's
equal share of the cap, in entries at the bytes it holds per entry; |C| = ``target_ratio`` x |M|.
A compression runs when a capped chunk arrives that would take the layer past |M| (before it goes
in: :func:`room_target`), not after a chunk, so the cache never holds more than the cap and the
last chunk of a stream is not followed by one. (A chunk too large for the room the entries never
evicted leave can pass the cap whatever goes: it lands first and the layer is brought to |C|
after it, its tokens scored with the video before them.) This is the authors' schedule: their code
compresses after each block of frames except the last (``if not is_last_block``), each block after
the first bringing |M| - |C| frames, so their cache holds exactly |M| (``block_size`` frames and the
system prompt) when the question comes, and the question and the answer are appended uncompressed.
Here the room a compression makes is the whole number of incoming chunks that fits in |M| - |C|
(at least one), so once it has compressed the cache likewise fills to exactly |M| before each
further compression, and a stream of equal chunks ends at |M| when its last chunk closes a cycle
(always when a chunk is over half of |M| - |C|: each compression then makes one chunk's room). A
conversation that streamed under a cap keeps following it: the question after the video, and
text later, are appended whole, never compressed to ``budget`` x tokens seen (the rule without a
cap); a later prefill that brings video without a cap is held under the same cap. Without any
cap (one prompt, ``budget`` < 1), the prompt's video tokens are compressed once after the prefill
so the layer holds ``budget`` x tokens seen. Only video tokens compete: the system prompt, text,
images and earlier answers stay (the method scores frames); a cap too small for them alone is
refused (``CapTooSmall``, naming what it counts and the smallest cap it can hold: the paper
compresses video tokens only). Decoded tokens are appended.

Where the authors' code (aiha-lab/InfiniPot-V) and the paper differ, this follows the paper:

* TaR's "same spatial place" is each entry's true frame and place (from its token position and
  the frame spans of the layout). The released code reshapes the compressed cache as if it still
  held whole frames in order, so after the first compression its "places" no longer line up.
* |M| and |C| are bytes here (the cap, and ``target_ratio`` of it) rather than the code's frame
  counts (``block_size`` 32 and ``compress_frame_num`` 24 in its scripts, whose ratio 0.75 is the
  default of ``target_ratio``); the code's ``tar_ratio`` 0.5 and ``query_ratio`` 0.25 (the share
  of the held frames that are the recent reference) are the defaults of the two other parameters.
  The code knows the video's length and shrinks its last compression to the room the frames left
  need; a stream does not, so a stream whose last cycle is cut short ends below |M| by the
  chunks it did not get.
* The code keeps only the system prompt besides the video; here every non-video token stays.
* VaN is the plain per-token value norm; the code's optional layer-wise pooling of the norms
  (off in its scripts) is not implemented.

Report (the base :class:`~backends.base.Report`): ``kept`` (per layer, (H_kv, S) positions) and
``layer_budgets`` (per layer, entries held / tokens seen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .base import AttentionCall, CapTooSmall, KVBackend, KVLayer
from .layout import Span
from .params import param

# what ``check_cap`` counts: every entry that is not a video frame's token
NEVER_EVICTED = "the system prompt, text, images and earlier answers (all but video frames)"


def tar_scores(keys: torch.Tensor, places: torch.Tensor, past: torch.Tensor, recent_keys: torch.Tensor) -> torch.Tensor:
    """TaR of every held entry: minus the mean cosine similarity of its key to the recent frames'
    keys at the same spatial place; ``-inf`` where ``past`` is False (not a scored past token).

    keys (H, S, D); places (H, S) spatial index of each entry in its frame; past (H, S) bool;
    recent_keys (H, R, T, D): the R recent frames' keys, T places each. The mean of cosines is
    the dot product with the mean of the recent frames' unit keys. Returns (H, S) float32."""
    reference = F.normalize(recent_keys.float(), dim=-1).mean(dim=1)  # (H, T, D)
    index = places.clamp(0, reference.shape[1] - 1)
    aligned = reference.gather(1, index[..., None].expand(-1, -1, reference.shape[-1]))  # (H, S, D)
    scores = -(F.normalize(keys.float(), dim=-1) * aligned).sum(dim=-1)
    return scores.masked_fill(~past, float("-inf"))


def van_scores(values: torch.Tensor) -> torch.Tensor:
    """VaN of every held entry: the L2 norm of its value vector. values (H, S, D) -> (H, S) float32."""
    return values.float().norm(dim=-1)


def select_entries(tar: torch.Tensor, van: torch.Tensor, video: torch.Tensor, recent: torch.Tensor,
                   keep_video: int, tar_count: int) -> torch.Tensor:
    """Ascending (H, S') indices kept per head: every non-video entry; of the video entries, the
    recent ones and the ``tar_count`` - recent best TaR among the past ones, then the largest VaN
    until ``keep_video``. All (H, S) tensors; ``recent`` holds the same count in every head."""
    chosen = recent.clone()
    extra = tar_count - int(recent[0].sum())
    if extra > 0:
        best = tar.topk(min(extra, tar.shape[1]), dim=1)
        chosen |= torch.zeros_like(chosen).scatter(1, best.indices, best.values > float("-inf"))
    priority = van.masked_fill(chosen | ~video, float("inf"))
    total = int((~video[0]).sum()) + keep_video
    return priority.topk(min(total, priority.shape[1]), dim=1).indices.sort(dim=1).values


def room_target(held: int, incoming: int, threshold: int, target: int, kept: int = 0) -> int | None:
    """Entries a layer holding ``held`` (``kept`` of them never evicted) is brought down to before
    ``incoming`` more arrive, under |M| = ``threshold`` with |C| = ``target``; None while they fit,
    or when they cannot fit whatever goes (the compression after the chunk then scores it with the
    video before it, rather than this one dropping that video for nothing). Sec. 3: on reaching |M|,
    compress, and only when more video arrives (the authors' code compresses after every block but
    the last). The room made is the whole number of such chunks that fits in |M| - |C|, at least
    one: the authors' blocks after the first are |M| - |C| frames, so their cache fills to exactly
    |M| before each compression and at the end; so does this one with chunks of one size, keeping
    at least |C| unless one chunk is larger than |M| - |C|."""
    if held + incoming <= threshold or kept + incoming > threshold:
        return None
    chunks = max(1, min(threshold - target, threshold - kept) // incoming)
    return threshold - chunks * incoming


def tar_share(keep_video: int, tar_ratio: float) -> int:
    """Video entries chosen by TaR (recent frames included) out of the ``keep_video`` a compression
    keeps; VaN fills the rest, rounded as the authors' code rounds it (VaN's share first)."""
    return keep_video - round((1 - tar_ratio) * keep_video)


NO_VIDEO = ("InfiniPot-V compresses video frames only: this conversation has no video, so it held the whole "
            "cache (not a result of compression).")


@dataclass(eq=False)
class InfiniPotV(KVBackend):
    name = "infinipot_v"
    title = "InfiniPot-V"
    does = "drops"
    paper = "https://arxiv.org/abs/2506.15745"
    summary = ("Streams a video under a fixed memory cap: each time the cache reaches it, keeps the newest frames, "
               "the past tokens that changed most at their place (TaR) and those with the largest value norms (VaN); "
               "query-agnostic.")
    streams_under_cap = True
    cap_replaces_budget = True  # |M| and |C| come from the cap; the budget is for one prompt without one
    target_ratio: float = param(0.75, "|C| / |M|: the share of the cap a compression keeps at least (the room it makes "
                                "is whole chunks within the rest; less only for a chunk larger than the rest) "
                                "(authors' scripts: 24 of 32 frames).",
                                0.1, 1.0, 0.05)
    tar_ratio: float = param(0.5, "Share of the video tokens a compression keeps (|C| less the text and images, "
                             "never evicted) chosen by temporal redundancy (TaR), the recent frames included; the rest "
                             "by value norm (VaN) (authors' code: 0.5, of the video tokens kept).", 0.0, 1.0, 0.05)
    recent_ratio: float = param(0.25, "Share of the held frames that are the newest, kept whole as TaR's reference "
                                "(authors' code: 0.25).", 0.0, 1.0, 0.05)
    frames: list[Span] = field(default_factory=list, init=False, repr=False)  # every video frame's tokens seen
    stream_cap: int | None = field(default=None, init=False, repr=False)  # the cap this conversation streamed under

    def before_forward(self, cache, call: AttentionCall) -> None:
        # a capped chunk that would take a layer past |M| makes its room first, so the last chunk of
        # a stream is never followed by a compression (and the cache never passes the cap)
        if not call.is_prefill or call.cap_bytes is None or not self.frames or int(call.positions[0]) == 0:
            return
        for layer in cache.layers:
            threshold = call.cap_entries(layer)
            if threshold is None:
                continue
            target = room_target(layer.get_seq_length(), len(call.positions), threshold,
                                 int(self.target_ratio * threshold), self.never_evicted(layer))
            if target is not None:
                self.compress(layer, target)

    def after_forward(self, cache, call: AttentionCall) -> None:
        if not call.is_prefill:
            return
        if int(call.positions[0]) == 0:  # a new conversation
            self.frames, self.stream_cap = [], None
        if call.layout is not None:
            self.frames += [f for v in call.layout.videos for f in v.frames]
        if call.cap_bytes is not None:
            self.stream_cap = call.cap_bytes
        self.report.note = None if self.frames else NO_VIDEO
        self.report.ensure_layers(call.num_layers, "kept", "layer_budgets")
        for i, layer in enumerate(cache.layers):
            self.check_cap(call, layer)
            target = self.layer_target(call, layer)
            if target is not None and self.frames:
                self.compress(layer, target)
            self.report.kept[i] = layer.positions
            self.report.layer_budgets[i] = layer.get_seq_length() / call.seen

    def layer_target(self, call: AttentionCall, layer: KVLayer) -> int | None:
        """Entries the layer is brought down to once a prefill is in, or None. Under a cap, |C| if
        the layer still holds more than |M| (a chunk larger than the room ``before_forward`` made).
        After a conversation streamed under a cap, a prefill without one is held under the same cap
        if it brought video, and otherwise appended whole (the question: the authors' code answers
        on the cache its last block left). Without a cap (one prompt): ``budget`` x tokens seen."""
        held = layer.get_seq_length()
        brought_video = call.layout is not None and bool(call.layout.videos)
        if call.cap_bytes is None and self.stream_cap is not None:
            if not brought_video:
                return None
            call = replace(call, cap_bytes=self.stream_cap)
        threshold = call.cap_entries(layer)
        if threshold is not None:
            return int(self.target_ratio * threshold) if held > threshold else None
        target = self.budget_tokens(call.seen)
        return target if target < held else None

    def check_cap(self, call: AttentionCall, layer: KVLayer) -> None:
        """Refuse a cap below the entries the method never evicts (the system prompt, text, images
        and decoded tokens: only video frames compete), which no compression could get under."""
        threshold = call.cap_entries(layer)
        if threshold is None:
            return
        kept = self.never_evicted(layer)
        if kept > threshold:  # a compression brings a layer to target_ratio x the cap: video fits above kept / ratio
            smallest = math.ceil(kept * layer.nbytes() / layer.get_seq_length()) * call.num_layers
            raise CapTooSmall(self.title, call.cap_bytes, smallest, NEVER_EVICTED,
                              math.ceil(smallest / self.target_ratio))

    def never_evicted(self, layer: KVLayer) -> int:
        """Entries per head that are not video frames' tokens (every head holds them all)."""
        return layer.get_seq_length() - (int(self.frame_of(layer.positions)[1][0].sum()) if self.frames else 0)

    def frame_of(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per entry (H, S): the index of the frame at or before it, whether it lies in that frame
        (a video token); and the frames' start and end positions."""
        starts = torch.tensor([f[0] for f in self.frames], device=positions.device)
        ends = torch.tensor([f[1] for f in self.frames], device=positions.device)
        frame = (torch.searchsorted(starts, positions, right=True) - 1).clamp(min=0)
        return frame, (positions >= starts[frame]) & (positions < ends[frame]), starts, ends

    def compress(self, layer: KVLayer, target: int) -> None:
        positions = layer.positions
        frame, video, starts, ends = self.frame_of(positions)
        keep_video = target - int((~video[0]).sum())
        if keep_video >= int(video[0].sum()):
            return
        keep_video = max(0, keep_video)
        tar_count = tar_share(keep_video, self.tar_ratio)
        recent = self.recent_frames(frame, video, tar_count)
        places = positions - starts[frame]
        keys, values = layer.keys[0], layer.values[0]
        if recent.any():
            heads, size = keys.shape[0], int(recent[0].sum())
            tokens = int(ends[-1] - starts[-1])
            recent_keys = keys[recent].view(heads, size // tokens, tokens, -1)
            same_size = (ends[frame] - starts[frame]) == tokens
            tar = tar_scores(keys, places, video & ~recent & same_size, recent_keys)
        else:
            tar = torch.full(positions.shape, float("-inf"), device=positions.device)
        layer.keep(select_entries(tar, van_scores(values), video, recent, keep_video, tar_count))

    def recent_frames(self, frame: torch.Tensor, video: torch.Tensor, tar_count: int) -> torch.Tensor:
        """(H, S) mask of the newest frames, ``recent_ratio`` of the frames' worth of video entries
        held, counting back only over frames every head holds whole and of the last frame's size,
        at most ``tar_count`` entries."""
        tokens = self.frames[-1][1] - self.frames[-1][0]
        wanted = min(max(1, int(self.recent_ratio * int(video[0].sum()) / tokens)), tar_count // tokens)
        counts = torch.zeros(frame.shape[0], len(self.frames), dtype=torch.long, device=frame.device)
        counts.scatter_add_(1, frame, video.long())
        whole = 0
        for f in range(len(self.frames) - 1, -1, -1):
            if whole == wanted or self.frames[f][1] - self.frames[f][0] != tokens or not bool((counts[:, f] == tokens).all()):
                break
            whole += 1
        first = len(self.frames) - whole
        return video & (frame >= first) if whole else torch.zeros_like(video)
