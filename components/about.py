"""The About tab: the KV cache in plain words first (a newcomer's first question), then when the methods
differ, what each registered method does, what the panels show."""

from __future__ import annotations

import gradio as gr

from kv_arena import service

INTRO = """
### What is the KV cache?
A language model writes its answer one token (a word piece) at a time. To choose each token it looks
back at every earlier token through *attention*, and for that it keeps two vectors per token, per
layer: a **key** and a **value**. Keeping them, instead of recomputing them for every new token, is
the **KV cache**. It grows with every token of the conversation.

### Why do images and video make it big?
A vision-language model turns a picture into many tokens: a 448 x 448 image becomes 256 tokens in
Qwen2-VL, 576 in LLaVA-1.5, and a video adds tokens for every frame (Qwen2-VL merges pairs of frames:
eight 448 px frames are 1,024 tokens). For Qwen2-VL-2B every token costs 28 KiB of cache
(2 vectors x 28 layers x 2 KV heads x 128 numbers x 2 bytes), so that short video holds 28 MiB per
user before a word of the answer. Reading the whole cache back for every new token is also what
makes decoding slow.

### How can it shrink?
The methods here keep less while trying to answer the same way. Some **drop** tokens the model pays
little attention to, some **merge** neighbours into one, some **quantise** the numbers to fewer bits,
some store a **low-rank** approximation, and some **reuse** the cache of an image seen before instead of
recomputing it. Three act even earlier, before the language model reads the media: VisionZip keeps an
image's most-attended tokens, Downsample reads a smaller picture, and EVS drops video tokens that barely
changed since the previous frame; what they leave out is never computed or cached at all. The *budget* is the fraction of the full cache a method keeps (1.0 keeps everything).

### When do the methods differ?
Mostly on **follow-ups** and longer answers, rarely on the first word of a first question. The first
word is chosen at the end of the prompt's pass, while the whole prompt is still in view; the method
drops, merges or quantises right after it. So a method can drop the very object you asked about and
still answer its colour right, then get the next question about that picture wrong. To see what a
method costs: ask a follow-up about another object, or pick "Before the question" (the picture is
compressed before anyone asks, as a stored picture is), or compare methods on the Compare tab, whose
examples ask a question and a follow-up. In detail:
- **Not on a one-word first answer** with the cache compressed *with the question*: that word comes
  from the prompt's own pass (the prefill), computed from the whole prompt before anything is evicted. Only the
  methods that are sparse *during* the prefill (ZipVL; FastV, whose later layers no longer see the
  visual tokens it dropped; VisionZip, whose language model never sees them) can change it.
- **On a follow-up** (Compare's "Then ask", or a second message in Chat): it is answered from what the
  method kept for the *first* question. A method that scored tokens by that question's attention
  (SnapKV, PyramidKV) may have dropped the object the follow-up asks about.
- **Before the question** ("When the cache is compressed": before the question): the media are
  prefilled and compressed first, as a cached picture is, and the question comes after, on top of
  the compressed cache; the first answer then depends on what was kept.
- **On long answers** (hub models, and tiny-arena-vl's lists and pairs): every token after the
  first is read from the compressed cache.
"""

PANELS = """
### What the panels show
- **KV memory**: bytes the cache really holds (codes, scales and factors included) after the prompt
  (x = 0) and after each new token, for the method and the full cache (dashed); the legend says the saving.
- **Speed**: time to first token (reading the media, the prompt pass and the method's own work) and
  decode speed in tokens per second, method next to the full cache, labelled with the ratio to it
  (0.80x) and drawn as a solid bar only where the same input gives the same verdict run after run: at
  least 8 decode steps each (the median step compared); a first token is one event, so its ratio needs
  at least 0.5 s and evenly timed decode steps beside it (a busy machine times them unevenly); else
  **–**, too short to time. A ratio within this machine's noise (±35%, wider when the steps themselves
  vary) is **≈**. Both are drawn as pale, hatched bars: the value was measured, the difference is not told. On the tiny offline model a step is mostly Python overhead, which says nothing about a
  method's speed at scale.
- Under the memory panel (and under Compare's panels), lines **computed, not measured**: the
  fraction of the full cache's KV measured here, projected onto real architectures (bytes per token
  from their configs, times this prompt's tokens; how many tokens or video frames fit in 16 GiB of
  KV), and what it means for speed there: a first token from the prefill's FLOPs, a decode step
  from the bytes it reads (weights and cache) at a GPU's peak rates; then the room it buys: how many
  frames of this video (or pictures like this one) fit beside Qwen2-VL-2B's weights on an A10G
  (24 GB) with the method and with the full cache.
- **Per-layer budget**: the share of the full cache's bytes each layer holds; methods that plan
  per layer show their plan as markers on the same scale (ZipVL: the bytes its split plans).
- **Kept visual tokens**: each cell of the picture is one visual token; dark red cells were dropped.
  AttentionPack keeps every token as low-rank factors: its clear cells are those held at full rank.
  ZipVL keeps every token in fewer bits: its clear cells are those at high precision. KIVI keeps every
  token in 2 bits: its clear cells are the newest ones, still exact. AdaKV's heads keep different
  numbers of tokens: a cell's shade is the share of heads that dropped it. VisionZip's clear cells are
  the tokens the language model read: the ones the vision encoder's summary token attended to most,
  and a few evenly spread ones that each stand for the mean of a group of similar, dropped neighbours.
- **Same tokens as full**: how many answer tokens match the full cache's answer, position by
  position (the end-of-turn token is not counted). **Right / wrong**: on the offline model's scenes
  (the examples, "New scene") the app knows the true answer and marks each one.
- **Quality vs memory** (Compare): each method as one point per turn, the fraction of the full cache's
  bytes it really held against its share of tokens equal to the full cache's answer; whatever a
  method's own knob (a budget, ZipVL's threshold, MPIC's mode), it lands on this one axis.
- A figure marked **cached** comes from an earlier full-cache run on exactly the same input, so the
  full cache is not paid for twice.

`tiny-arena-vl`, the offline default: {arena} Most of each picture is empty, as in the photos the
compression methods were made for.
The other offline models (`tiny-…`, `random:…`) have random weights:
their answers are nonsense text. Every figure in the panels is measured here; only the lines marked
*computed, not measured* are worked out (from real models' sizes), and they say so.
""".replace("{arena}", service.model_description(service.ARENA))  # what the served generation reads


def methods_table() -> str:
    """One row per method: its title (linking to its paper) and one plain sentence on what it does
    (the paper's terms are on the method's card beside the chat)."""
    rows = ["| Method (links to its paper) | What it does |", "|---|---|"]
    for spec in service.method_specs():
        title = service.shown_title(spec)  # a method from another package says which
        name = f"[{title}]({spec['paper']})" if spec["paper"] else title
        rows.append(f"| {name} | {spec['plain']} |")
    return "\n".join(rows)


def build_about() -> None:
    gr.Markdown(INTRO)
    gr.Markdown("### The methods\n" + methods_table())
    gr.Markdown(PANELS)
