"""The Chat tab's words and panels for one answer: the status line under the chat (figures, right or
wrong, why a figure would mislead), the line under the memory panel, and the panels' figures."""

from __future__ import annotations

from kv_arena import service

from . import at_scale, plots
from .plots import Drawn, fmt_bytes
from .settings import realised_note

def reference_run(view: service.ChatView) -> Drawn | None:
    """The full cache's answer as the panels draw it (None for the full cache itself)."""
    ref = view.reference
    return Drawn("Full cache", ref.metrics, ref.layers, ref.cached) if ref else None


def status_line(view: service.ChatView, settings: service.Settings, with_media: bool = False) -> str:
    """One line of figures under the chat, in words (``with_media``: the message carried images or
    a video), and under it any :func:`explanation`."""
    m, ref = view.metrics, view.reference
    parts = [f"**{view.method}**", f"{m.new_tokens} new tokens", f"KV cache {fmt_bytes(m.kv_bytes)}"]
    if ref:
        full = ref.metrics.kv_trace
        same_point = full[min(len(m.kv_trace) - 1, len(full) - 1)]
        parts[-1] += f" vs {fmt_bytes(same_point)} full ({1 - m.kv_bytes / same_point:.0%} saved)"
        parts.append(f"after the prompt it held {plots.kept_fraction(view, ref):.2f}x of the full KV")
    if view.stream:
        parts.append(stream_line(view.stream, settings.num_frames))
    parts += [f"first token after {m.ttft_s:.2f} s", decode_speed(m, view.done)]
    if view.right is not None:
        parts.append("✓ **right**" if view.right else f"✗ **wrong** (true: {view.truth})")
    elif view.unmarked and view.done:
        parts.append(f"not marked: {view.unmarked}")
    if view.agreement is not None:
        parts.append(f"{view.agreement:.0%} of its answer tokens match the full cache's")
    if view.done:
        parts.append(model_time(m, ref))
    if ref and ref.cached:
        parts.append("full-cache figures reused from an earlier run on this input (cached)")
    if view.mpic:
        parts.append(mpic_line(view.mpic))
    if service.has_random_weights(settings.model):
        parts.append("random weights: the text is nonsense, the figures are real")
    line = " · ".join(parts)
    why = explanation(view, settings, with_media)
    return line + (f"\n\n{why}" if why else "")


def hint_line(hint: str) -> str:
    """A model-trained-here hint (``service.media_hint``) with a link to what the model reads: the
    sidebar's folded card, said there once."""
    return f"{hint} [What it reads](#model-about)" if hint else ""


def decode_speed(metrics: service.Meters, done: bool = True) -> str:
    """The decode speed, rounded as a stopwatch can tell it; none where the Speed panel says it is
    too short to time (a 2-token answer's one step read 958.7 tokens/s, and 35 or 497 on the next run)."""
    rate, steps = metrics.decode_tok_s, len(metrics.step_s)
    if done and steps < plots.MIN_STEPS:  # while streaming the steps are still coming
        return f"decode speed: too short to time ({steps} decode step{'s' * (steps != 1)}, under {plots.MIN_STEPS})"
    return f"{rate:.0f} tokens/s" if rate >= 10 else f"{rate:.1f} tokens/s"


def explanation(view: service.ChatView, settings: service.Settings, with_media: bool) -> str:
    """One line beside an answer whose figures would mislead without it: right although the method
    compressed the picture (the first word comes from the prompt's pass, before the method
    compresses), or holding more than its budget."""
    ref = view.reference
    if not view.done or ref is None:
        return ""
    held = plots.kept_fraction(view, ref)
    lines = []
    if view.right and with_media and settings.question_after is False and held is not None and held < service.HOLDS_ALL:
        lines.append(f"*Why right although {view.method} {what_it_did(settings.method)}:* the first word is chosen "
                     "at the end of the prompt's pass, before the method compresses. Ask a follow-up about another "
                     "object, or pick \"Before the question\", to see what that cost.")
    uses_budget = service.method_spec(settings.method)["uses_budget"]
    if view.note and held is not None and held > settings.budget + 0.05:  # the method's own reason (EVS: no video)
        lines.append(f"*Why {held:.2f}x with a budget of {settings.budget:.2f}:* {view.note}")
    elif uses_budget and held is not None and held > settings.budget + 0.05:
        lines.append(f"*Why {held:.2f}x with a budget of {settings.budget:.2f}:* on a prompt this short, what "
                     f"{view.method} never evicts (its window of recent tokens, sinks, the text) is more than the "
                     "budget; on a longer prompt it holds its budget.")
    return "\n\n".join(lines)


# what a method did to the picture, by what it does (``service.method_spec(...)["does"]``)
DID = {"drops": "dropped part of the picture", "merges": "merged part of the picture",
       "quantises": "stored the picture in fewer bits", "low-rank": "stored the picture as low-rank factors",
       "reuses": "reused a stored copy of the picture", "downsamples": "read a smaller copy of the picture"}


def what_it_did(method: str) -> str:
    """What ``method`` did to the picture, in words ("dropped part of the picture", "stored the
    picture in fewer bits"...)."""
    does = [d.strip() for d in service.method_spec(method)["does"].split(",")]
    return " and ".join(DID.get(d, "compressed the picture") for d in does)


def stream_line(stream: service.StreamView, asked: int | None = None) -> str:
    """How the media streamed in: frames (and why fewer than the ``asked`` of the slider), chunks,
    the cap and the most the cache held meanwhile."""
    line = f"streamed {stream.frames_total} frames in {len(stream.frames)} chunks"
    if asked and stream.frames_total < asked:
        line += f" (all the media have: the slider asked for {asked})"
    peak = fmt_bytes(max(stream.peak_kv_bytes, default=0))
    if stream.capped:
        return line + f" under a cap of {fmt_bytes(stream.cap_bytes)} (at most {peak} while a chunk went in)"
    return line + f" without a cap (up to {peak})"


def model_time(metrics: service.Meters, reference: service.ReferenceView | None) -> str:
    """The model's own time for this message (first token and decode), and the full-cache
    reference's when it was computed now: what the wait was made of, besides the app."""
    line = f"model time {metrics.ttft_s + metrics.decode_s:.3f} s"
    if reference and not reference.cached:
        line += f" + {reference.metrics.ttft_s + reference.metrics.decode_s:.3f} s for the full-cache reference"
    return line


def mpic_line(reuse: service.ReuseSummary) -> str:
    """What MPIC reused from the store for this prompt, and any image it had to recompute."""
    line = f"{reuse.mode}: {reuse.reused} prompt tokens reused from the media store, {reuse.recomputed} computed"
    # a stored image the linker could not use says why ("recomputed (not stored)", a damaged file...)
    missed = [f"image/video {i + 1} {why}" for i, why in enumerate(reuse.visuals) if why.startswith("recomputed (")]
    if missed:
        line += " (" + "; ".join(missed) + ")"
    if reuse.note:
        line += f"; {reuse.note}"
    return line


def panels(view: service.ChatView) -> tuple:
    """The memory, speed and layer panels."""
    run, ref = Drawn(view.method, view.metrics, view.layers, stream=view.stream), reference_run(view)
    return plots.memory_figure([run], ref), plots.speed_figure([run], ref), plots.layer_figure([run], ref)


def measured(view: service.ChatView) -> tuple[str, str | None]:
    """The line under the memory panel (computed at real scale) and the note under the Method on
    what the method really held (both from the fraction measured after the prompt; None: nothing
    measured)."""
    if view.reference is None and not view.is_reference:
        return "", no_reference_note(view)
    fraction = 1.0 if view.is_reference else plots.kept_fraction(view, view.reference)
    tokens = max(view.context_tokens, view.metrics.prompt_tokens)  # the whole conversation the cache holds
    note = realised_note(view.method, fraction)
    if view.note:  # the method's own line (EVS on pictures: it held the whole cache, which is no result)
        note = f"{note} {view.note}"
    return (at_scale.scale_line(view.method, fraction, tokens, conversation=tokens > view.metrics.prompt_tokens,
                                visuals=view.visuals), note)


def no_reference_note(view: service.ChatView) -> str:
    """Why a chat has no "vs full" figure (its video is longer than one prompt: the full cache's
    answer would prefill it all at once), and the full cache's bytes computed against the cap."""
    line = ("**No full-cache reference** for this chat: its video is longer than one prompt holds, and the full "
            "cache's answer would prefill all of it at once, which is what streaming under a cap avoids.")
    stream = view.stream
    if stream and stream.full_kv_bytes:
        cap = f" against the cap of {fmt_bytes(stream.cap_bytes)}" if stream.cap_bytes else ""
        line += (f" *Computed:* a full cache would hold {fmt_bytes(stream.full_kv_bytes)} after the media{cap}; "
                 f"{view.method} held {fmt_bytes(view.metrics.kv_bytes_prefill)} after the question.")
    return line
