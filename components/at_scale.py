"""The line under the KV memory panel: the kept fraction measured here, projected onto real
architectures (computed by :mod:`kv_arena.service.at_scale`, labelled as computed, not measured)."""

from __future__ import annotations

from kv_arena.service import at_scale, capacity

from . import plots

SHOWN = ("Qwen/Qwen2.5-VL-7B-Instruct", "llava-hf/llava-1.5-7b-hf")  # a GQA and a dense-attention 7B
MEMORY = 16 * 2**30


def _count(tokens: int | None, frames: int | None) -> str:
    if tokens is None:
        return "unbounded"
    return f"{tokens:,} tokens" + (f" ({frames:,} frames)" if frames is not None else "")


def scale_line(method: str, fraction: float | None, prompt_tokens: int, conversation: bool = False,
               visuals=None) -> str:
    """Markdown: this prompt and 16 GiB of KV on real architectures, full cache -> ``method`` at
    the measured ``fraction`` of the full cache's bytes, then what that leaves room for on the
    Space's card (frames of the chat's video in ``visuals``, else pictures, else tokens). Empty when
    nothing was measured. ``conversation``: ``prompt_tokens`` counts the whole conversation the
    cache holds (a follow-up's cache holds the earlier turns too), said so."""
    if fraction is None or prompt_tokens <= 0:
        return ""
    this = "this conversation" if conversation else "this prompt"
    counted = "tokens in the conversation so far" if conversation else "prompt tokens"
    rows = []
    for arch in at_scale.architectures():
        if arch.name not in SHOWN:
            continue
        p = at_scale.project(arch, fraction, prompt_tokens, MEMORY)
        rows.append(f"- **{arch.name.split('/')[-1]}** ({plots.fmt_bytes(p.bytes_per_token)}/token): {this} "
                    f"{plots.fmt_bytes(p.prompt_full_bytes)} → {plots.fmt_bytes(p.prompt_method_bytes)}; "
                    f"16 GiB fits {_count(p.fit_full_tokens, p.fit_full_frames)} → "
                    f"{_count(p.fit_method_tokens, p.fit_method_frames)}")
    return (f"*Computed, not measured:* this {fraction:.2f}x at real scale (full cache → {method}, "
            f"{prompt_tokens:,} {counted})\n" + "\n".join(rows) + "\n" + speed_line(fraction, prompt_tokens)
            + "\n\n" + capacity.space_room({method: fraction}, visuals))


def speed_line(fraction: float, prompt_tokens: int, tokens_shown: tuple[int, ...] = (32_768,)) -> str:
    """Markdown: time to first token and decode step on a real architecture at this many tokens
    (and at a long context), full cache → method, from bytes and FLOPs at the GPU's peak rates.
    The speed measured here is Python overhead on a tiny model; this is what the bytes mean there."""
    arch = next(a for a in at_scale.architectures() if a.name == SHOWN[0])
    lines = []
    for tokens in (prompt_tokens, *tokens_shown):
        s = at_scale.speed(arch, fraction, tokens)
        lines.append(f"- **{arch.name.split('/')[-1]} on {s.hardware}** at {tokens:,} tokens: first token "
                     f"≈ {s.ttft_s * 1e3:.0f} ms for both (same prefill); a decode step ≈ "
                     f"{s.step_full_s * 1e3:.2f} → {s.step_method_s * 1e3:.2f} ms "
                     f"(weights {plots.fmt_bytes(s.weight_bytes)} + KV {plots.fmt_bytes(s.kv_full_bytes)} "
                     f"→ {plots.fmt_bytes(s.kv_full_bytes * fraction)} read per step, at peak rates)")
    return "\n".join(lines)


def compare_speed_line(fractions: dict[str, float], prompt_tokens: int, long: int = 32_768, visuals=None) -> str:
    """Markdown for Compare: a decode step of each method on a real architecture, at this prompt's
    tokens and at a long context, from bytes at the GPU's peak rates, then the room each leaves on
    the Space's card for this input's media (``visuals``) (computed, not measured)."""
    arch = next(a for a in at_scale.architectures() if a.name == SHOWN[0])
    lines = []
    for tokens in (prompt_tokens, long):
        full = at_scale.speed(arch, 1.0, tokens)
        steps = ", ".join(f"{name} {at_scale.speed(arch, f, tokens).step_method_s * 1e3:.2f}"
                          for name, f in fractions.items())
        lines.append(f"- at {tokens:,} tokens: first token ≈ {full.ttft_s * 1e3:.0f} ms for all (same prefill); "
                     f"decode step (ms) full {full.step_full_s * 1e3:.2f}, {steps}")
    return (f"*Computed, not measured* ({arch.name.split('/')[-1]} on {full.hardware}, from bytes and FLOPs at "
            "peak rates; the speeds measured above are a tiny model's Python overhead):\n" + "\n".join(lines)
            + ("\n\n" + capacity.space_room(fractions, visuals) if fractions else ""))
