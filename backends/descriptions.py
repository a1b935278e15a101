"""A method described in plain values, for the UI's cards and controls and ``kv_arena.bench --list``:
its name, title, paper, summary (in its paper's terms), one plain sentence for a newcomer (:data:`PLAIN`),
what it holds, each parameter's spec (budget first), and for a method from another package the
package it came from (:func:`shown_title` puts it beside the title).

Only what shows a method reads this; a method itself never does.
"""

from __future__ import annotations

from typing import Any

from . import package_of
from .base import KVBackend
from .params import BUDGET


# One sentence per method in plain words, for a reader who has not read its paper (the About tab);
# a method not listed here is described by the first sentence of its summary.
PLAIN = {
    "full": "Keeps everything: the reference every other method is measured against.",
    "adakv": "Like SnapKV, but heads whose attention is spread out may keep more tokens than the others.",
    "attention_pack": "Keeps every image token, but stores most of them in a compressed form; the most looked-at "
                      "ones stay nearly exact.",
    "downsample": "Shrinks the picture before the model reads it, as if you had uploaded a smaller one.",
    "elastic_cache": "Blends each token it lets go into a similar one it keeps, instead of just deleting it.",
    "evs": "For videos: drops the parts of each frame that did not change since the frame before; pictures are "
           "left as they are.",
    "fastv": "After the first two layers, the model stops reading the half of the image it looks at least.",
    "fp8": "Keeps every token, but stores its numbers in 8 bits instead of 16, as vLLM's fp8 cache does.",
    "h2o": "Keeps the tokens the model has looked at most so far, and the newest ones.",
    "infinipot_v": "For long videos: keeps memory under a fixed cap, keeping the newest frames and the parts of "
                   "older ones that changed most or stand out most.",
    "int4": "Keeps every token, but stores its numbers in 4 bits instead of 16, as vLLM's int4 cache does.",
    "kivi": "Keeps every token, but stores its numbers with 2 bits instead of 16 (the newest ones stay exact).",
    "mpic": "Reuses what it computed for a picture it has seen before, instead of reading the picture again.",
    "pyramidkv": "Like SnapKV, but the first layers keep more tokens and the last layers fewer.",
    "random": "Keeps the text and a random pick of the picture's tokens: the baseline a smarter method must beat.",
    "snapkv": "Keeps the tokens the end of your message (usually the question) looks at most.",
    "streamingllm": "Keeps the first few tokens and the most recent ones, and drops everything in between.",
    "visionzip": "Picks the most important parts of a picture before the language model reads it; the rest is "
                 "never read at all (LLaVA-1.5 models only).",
    "vl_cache": "Gives more memory to the layers that need it, and keeps the tokens the question looks at most.",
    "zipvl": "Keeps the most looked-at tokens with more bits and the rest with fewer, and skips the rest while "
             "reading the prompt.",
}


def plain(method: type[KVBackend]) -> str:
    """``method`` in one plain sentence (:data:`PLAIN`, else its summary's first sentence)."""
    return PLAIN.get(method.name) or method.summary.split(". ")[0].rstrip(".") + "."


def describe(method: type[KVBackend]) -> dict[str, Any]:
    """``method``'s class attributes and parameter specs (:meth:`~backends.params.Param.to_dict`), JSON-ready."""
    return {
        "name": method.name,
        "title": method.title,
        "paper": method.paper,
        "summary": method.summary,
        "plain": plain(method),
        "does": method.does,
        "is_reference": method.is_reference,
        "holds_budget_while_decoding": method.holds_budget_while_decoding,
        "uses_budget": method.uses_budget,
        "streams_under_cap": method.streams_under_cap,
        "cap_replaces_budget": method.cap_replaces_budget,
        # it picks an image's tokens before the language model reads them (VisionZip): models whose
        # vision tower lacks what it reads refuse it
        "chooses_image_tokens": method.select_visual is not KVBackend.select_visual,
        # it shrinks the media before the vision tower (Downsample): models whose processor sizes every
        # picture to one grid refuse it
        "resizes_media": method.resizes_media,
        "params": [BUDGET.to_dict()] + [p.to_dict() for p in method.param_specs()],
        # the package a method from another package (a plugin, docs/plugins.md) came from; None: the project's own
        "package": package_of(method.name),
    }


def shown_title(spec: dict[str, Any]) -> str:
    """A method's title as the pickers and About show it: a plugin's says its package."""
    return f"{spec['title']} (from {spec['package']})" if spec.get("package") else spec["title"]
