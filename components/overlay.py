"""Which visual tokens the cache kept, drawn on the picture the model saw.

Each visual token covers one cell of the image (a merged 28 px patch for Qwen-VL, a 14 px patch
for LLaVA). Kept cells stay as they are; dropped ones fade to dark red, in proportion to the
share of KV heads (and, averaged over layers, of layers) that dropped them. A video becomes a
strip of frames, one per temporal token.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from kv_arena import service
from kv_arena.service.view_types import KeptVisual

MEAN = "mean over layers"
DROPPED = np.array([110, 0, 0], dtype=np.float32)
TILE = 336  # longest side of one drawn frame, in pixels


def layer_choices(num_layers: int) -> list[str]:
    return [MEAN] + [f"layer {i + 1}" for i in range(num_layers)]


def layer_index(choice: str | None) -> int | None:
    """'layer 3' -> 2; the mean (or nothing) -> None."""
    if not choice or choice == MEAN:
        return None
    return int(choice.split()[-1]) - 1


def draw(picture: np.ndarray, keep: np.ndarray) -> Image.Image:
    """Picture (H, W, 3) uint8 and keep shares (h, w) in [0, 1] -> the overlay image."""
    h, w = keep.shape
    cell = max(1, TILE // max(h, w))
    base = np.asarray(Image.fromarray(picture).convert("RGB").resize((w * cell, h * cell), Image.BICUBIC), np.float32)
    share = np.kron(keep, np.ones((cell, cell), np.float32))[..., None]
    faded = base * 0.3 + DROPPED * 0.7
    out = base * share + faded * (1 - share)
    if cell >= 6:  # thin cell borders make single tokens visible
        out[::cell, :, :] *= 0.85
        out[:, ::cell, :] *= 0.85
    return Image.fromarray(out.clip(0, 255).astype(np.uint8))


def render(visual: KeptVisual, layer: int | None = None) -> tuple[Image.Image, str]:
    """One image or video of the service's ``kept_visuals`` -> (overlay, caption)."""
    keep = visual.keep  # (layers, t, h, w)
    keep = keep.mean(0) if layer is None or layer >= keep.shape[0] else keep[layer]
    tiles = [draw(picture, grid) for picture, grid in zip(visual.pictures, keep)]
    if len(tiles) == 1:
        image = tiles[0]
    else:  # a video: its frames in rows of FRAMES_PER_ROW, in order (one long strip shrank to a sliver)
        image = frame_grid(tiles)
    where = "" if layer is None else f" at layer {layer + 1}"  # the gallery's label says: mean over layers
    # short: a caption is one line; the meaning is "kept", or MPIC's "reused" (shaded: recomputed)...
    caption = f"{visual.label}: {keep.mean():.0%} of {keep.size} {visual.meaning}{where}"
    return image, caption


CAPTION_PX = 14  # at a picture's own width; wider pictures (shown shrunk) get a larger font
FRAMES_PER_ROW = 4


def frame_grid(tiles: list[Image.Image], gap: int = 6) -> Image.Image:
    """Video frames in rows of :data:`FRAMES_PER_ROW`, left to right then top to bottom."""
    w, h = max(t.width for t in tiles), max(t.height for t in tiles)
    cols = min(FRAMES_PER_ROW, len(tiles))
    rows = -(-len(tiles) // cols)
    image = Image.new("RGB", (cols * w + gap * (cols - 1), rows * h + gap * (rows - 1)), "white")
    for i, tile in enumerate(tiles):
        image.paste(tile, ((i % cols) * (w + gap), (i // cols) * (h + gap)))
    return image


def with_caption(image: Image.Image, caption: str) -> Image.Image:
    """The caption written on a white strip under the picture, never over it (Gradio's gallery
    writes captions over the bottom of the image, which hid the bottom row of cells)."""
    size = max(CAPTION_PX, image.width // 40)  # about 14 px wherever the gallery shows the picture ~560 px wide
    font = ImageFont.load_default(size=size)
    width = max(image.width, int(ImageDraw.Draw(image).textlength(caption, font=font)) + 8)
    out = Image.new("RGB", (width, image.height + size + 10), "white")
    out.paste(image, (0, 0))
    ImageDraw.Draw(out).text((4, image.height + 4), caption, fill=(40, 40, 40), font=font)
    return out


def gallery(visuals: list[KeptVisual] | None, choice: str | None = None, prefix: str = "") -> list[tuple[Image.Image, None]]:
    """Gallery items for a list of visuals at the chosen layer: each picture with its caption
    under it (drawn in; the gallery's own caption would cover the picture)."""
    layer = layer_index(choice)
    return [(with_caption(*_prefixed(render(visual, layer), prefix)), None) for visual in visuals or []]


def private(session: service.Session, items: list[tuple[Image.Image, None]]) -> list[tuple[str, None]]:
    """Gallery items as files only the session's client may read, which go with the session: an
    overlay shows a private upload, so it never enters Gradio's public cache as an image would."""
    paths = service.save_private_images(session, [image for image, _ in items])
    return [(path, caption) for path, (_, caption) in zip(paths, items)]


def captions(visuals: list[KeptVisual] | None, choice: str | None = None, prefix: str = "") -> list[str]:
    """The captions :func:`gallery` draws, as text."""
    return [prefix + render(visual, layer_index(choice))[1] for visual in visuals or []]


def _prefixed(rendered: tuple[Image.Image, str], prefix: str) -> tuple[Image.Image, str]:
    return rendered[0], prefix + rendered[1]
