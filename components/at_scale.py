"""The line under the KV memory panel: the kept fraction measured here, projected onto real
architectures (computed by :mod:`engine.service.at_scale`, labelled as computed, not measured)."""

from __future__ import annotations

from engine.service import at_scale

from . import plots

SHOWN = ("Qwen/Qwen2.5-VL-7B-Instruct", "llava-hf/llava-1.5-7b-hf")  # a GQA and a dense-attention 7B
MEMORY = 16 * 2**30


def _count(tokens: int | None, frames: int | None) -> str:
    if tokens is None:
        return "unbounded"
    return f"{tokens:,} tokens" + (f" ({frames:,} frames)" if frames is not None else "")


def scale_line(method: str, fraction: float | None, prompt_tokens: int) -> str:
    """Markdown: this prompt and 16 GiB of KV on real architectures, full cache -> ``method`` at
    the measured ``fraction`` of the full cache's bytes. Empty when nothing was measured."""
    if fraction is None or prompt_tokens <= 0:
        return ""
    rows = []
    for arch in at_scale.architectures():
        if arch.name not in SHOWN:
            continue
        p = at_scale.project(arch, fraction, prompt_tokens, MEMORY)
        rows.append(f"- **{arch.name.split('/')[-1]}** ({plots.fmt_bytes(p['bytes_per_token'])}/token): this prompt "
                    f"{plots.fmt_bytes(p['prompt_full_bytes'])} → {plots.fmt_bytes(p['prompt_method_bytes'])}; "
                    f"16 GiB fits {_count(p['fit_full_tokens'], p['fit_full_frames'])} → "
                    f"{_count(p['fit_method_tokens'], p['fit_method_frames'])}")
    return (f"*Computed, not measured:* this {fraction:.2f}x at real scale (full cache → {method}, "
            f"{prompt_tokens:,} prompt tokens)\n" + "\n".join(rows))
