"""Photo-like pictures outside v3's scenes, for v3.1 to answer "unknown" (issue #57).

v3's out-of-scope pictures (noise, blank, gradients, soft blobs, bar charts) did not teach it what a
photo looks like: the app's own street photo got "unknown" 4 times in 12. These are drawn to look
more like what visitors send: natural textures (several octaves of noise in a material's colours),
a street or a landscape (sky, buildings with windows, road, trees), a still life of things that are
not the scenes' shapes (stars, hearts, crescents, leaves, shaded and overlapping, on a textured
table), and a blurred close-up with a vignette. Drawn larger and resized, sometimes JPEG, as a
camera's file would be.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from . import drawn_scenes as scenes
from .scene_items import Item, Question

KINDS = ("texture", "street", "still_life", "close_up")
SUBJECT = "subject"  # one big coloured thing: added at v3.1's step 8,500 (photo_item's subject_share)
MATERIALS = (((120, 80, 40), (190, 140, 90)), ((90, 90, 90), (170, 165, 160)), ((40, 90, 30), (140, 180, 80)),
             ((180, 160, 120), (240, 225, 190)), ((60, 40, 30), (140, 100, 70)), ((30, 60, 110), (150, 190, 230)))


def _noise(rng, w: int, h: int, octaves: int = 5) -> np.ndarray:
    """Value noise in [0, 1], octaves summed (a material's grain and blotches)."""
    out = np.zeros((h, w), np.float32)
    amp, total = 1.0, 0.0
    for o in range(octaves):
        cells = 2 ** (o + 1)
        small = rng.random((cells + 1, cells + 1)).astype(np.float32)
        img = Image.fromarray((small * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC)
        out += amp * np.asarray(img, np.float32) / 255
        total += amp
        amp *= 0.55
    return out / total


def _between(a, b, t: np.ndarray) -> np.ndarray:
    a, b = np.array(a, np.float32), np.array(b, np.float32)
    return a + (b - a) * t[..., None]


def _texture(rng, w: int, h: int) -> Image.Image:
    lo, hi = MATERIALS[int(rng.integers(len(MATERIALS)))]
    t = _noise(rng, w, h)
    if rng.random() < 0.5:  # grain along one direction (wood, fabric)
        yy, xx = np.mgrid[0:h, 0:w]
        t = 0.6 * t + 0.4 * (0.5 + 0.5 * np.sin(xx / rng.uniform(2, 8) + 6 * t))
    return Image.fromarray(np.clip(_between(lo, hi, t), 0, 255).astype(np.uint8))


def _street(rng, w: int, h: int) -> Image.Image:
    horizon = int(h * rng.uniform(0.35, 0.6))
    sky_top, sky_low = (int(rng.integers(60, 140)), int(rng.integers(120, 190)), int(rng.integers(190, 255))), \
        tuple(int(v) for v in rng.integers(180, 250, 3))
    sky = _between(sky_top, sky_low, np.broadcast_to(np.linspace(0, 1, horizon)[:, None], (horizon, w)))
    ground = _between((70, 70, 75), (120, 115, 110), _noise(rng, w, h - horizon, 4))
    img = Image.fromarray(np.clip(np.concatenate([sky, ground]), 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    x = -rng.uniform(0, 0.1) * w
    while x < w:  # buildings with rows of windows
        bw, top = rng.uniform(0.08, 0.25) * w, horizon - rng.uniform(0.1, 0.5) * h
        wall = tuple(int(v) for v in rng.integers(60, 200, 3))
        d.rectangle((x, top, x + bw, horizon), fill=wall)
        glass = tuple(int(v) for v in rng.integers(20, 90, 3))
        for wy in np.arange(top + 0.02 * h, horizon - 0.03 * h, 0.05 * h):
            for wx in np.arange(x + 0.02 * w, x + bw - 0.02 * w, 0.035 * w):
                d.rectangle((wx, wy, wx + 0.015 * w, wy + 0.025 * h), fill=glass)
        x += bw + rng.uniform(0, 0.03) * w
    for _ in range(int(rng.integers(0, 5))):  # trees: a trunk and a ragged crown
        tx, ty = rng.uniform(0, w), horizon + rng.uniform(0, 0.2) * h
        d.rectangle((tx - 0.006 * w, ty - 0.12 * h, tx + 0.006 * w, ty), fill=(80, 55, 35))
        for _ in range(12):
            r = rng.uniform(0.02, 0.05) * w
            cx, cy = tx + rng.normal(0, 0.025 * w), ty - 0.15 * h + rng.normal(0, 0.03 * h)
            d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(int(rng.integers(20, 80)), int(rng.integers(80, 150)), 40))
    d.line((0, h * 0.85, w, h * rng.uniform(0.8, 0.95)), fill=(230, 230, 220), width=max(2, h // 60))
    return img


def _star(cx, cy, r, points: int, turn: float):
    return [(cx + (r if k % 2 == 0 else 0.45 * r) * math.cos(turn + k * math.pi / points),
             cy + (r if k % 2 == 0 else 0.45 * r) * math.sin(turn + k * math.pi / points)) for k in range(2 * points)]


def _heart(cx, cy, r):
    return [(cx + r * 0.06 * 16 * math.sin(t) ** 3,
             cy - r * 0.06 * (13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)))
            for t in np.linspace(0, 2 * math.pi, 40)]


def _leaf(cx, cy, r, turn):
    pts = [(r * math.cos(t), 0.45 * r * math.sin(t) * abs(math.cos(t / 2))) for t in np.linspace(0, 2 * math.pi, 30)]
    return [(cx + x * math.cos(turn) - y * math.sin(turn), cy + x * math.sin(turn) + y * math.cos(turn)) for x, y in pts]


def _still_life(rng, w: int, h: int) -> Image.Image:
    img = _texture(rng, w, h)
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 14))):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.06, 0.22) * min(w, h)
        rgb = tuple(int(v) for v in rng.integers(0, 256, 3))
        dark = tuple(max(0, v - 70) for v in rgb)
        kind = int(rng.integers(4))
        if kind == 0:
            poly = _star(cx, cy, r, int(rng.integers(5, 9)), rng.uniform(0, math.pi))
        elif kind == 1:
            poly = _heart(cx, cy, r)
        elif kind == 2:
            poly = _leaf(cx, cy, r, rng.uniform(0, math.pi))
        else:  # a crescent: a disc with a bite taken out by the table's colour
            d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=rgb)
            off = 0.45 * r
            d.ellipse((cx - r + off, cy - r, cx + r + off, cy + r), fill=tuple(int(v) for v in np.asarray(img)[
                int(np.clip(cy, 0, h - 1)), int(np.clip(cx + r + off + 1, 0, w - 1))]))
            continue
        d.polygon([(x + 0.08 * r, y + 0.08 * r) for x, y in poly], fill=dark)  # a shadow
        d.polygon(poly, fill=rgb)
    return img


def _close_up(rng, w: int, h: int) -> Image.Image:
    img = np.asarray(_texture(rng, w, h), np.float32)
    blobs = _noise(rng, w, h, 3)
    tint = np.array(rng.integers(0, 256, 3), np.float32)
    img = img * (1 - 0.5 * blobs[..., None]) + tint * 0.5 * blobs[..., None]
    yy, xx = np.mgrid[0:h, 0:w]
    vignette = 1 - 0.6 * (((xx / w - 0.5) ** 2 + (yy / h - 0.5) ** 2) * 2)
    out = Image.fromarray(np.clip(img * vignette[..., None], 0, 255).astype(np.uint8))
    return out.filter(ImageFilter.GaussianBlur(float(rng.uniform(1, 5))))


def _silhouette(rng, w: int, h: int) -> Image.Image:
    """The outline of a photo's one big subject, as a mask: a tower narrowing upwards, a vehicle, or
    an irregular round thing (a flower, a balloon, a fruit), 35-90% of the picture's height."""
    mask = Image.new("L", (w, h), 0)
    d = ImageDraw.Draw(mask)
    size = rng.uniform(0.35, 0.9) * h
    cx, base = rng.uniform(0.3, 0.7) * w, h - rng.uniform(0, 0.2) * h
    form = int(rng.integers(3))
    if form == 0:  # a tower: a tall narrowing trapezoid, an arch cut from its foot
        half = rng.uniform(0.15, 0.35) * size
        top = base - size
        d.polygon([(cx - half, base), (cx - 0.04 * size, top), (cx + 0.04 * size, top), (cx + half, base)], fill=255)
        d.ellipse((cx - 0.6 * half, base - 0.45 * size, cx + 0.6 * half, base + 0.3 * size), fill=0)  # the arch
    elif form == 1:  # a vehicle: a body and a cabin
        length, tall = size * rng.uniform(1.2, 1.8), size * rng.uniform(0.35, 0.5)
        d.rounded_rectangle((cx - length / 2, base - tall, cx + length / 2, base - 0.15 * tall), radius=0.15 * tall, fill=255)
        d.rounded_rectangle((cx - length / 4, base - 1.6 * tall, cx + length / 4, base - tall), radius=0.2 * tall, fill=255)
    else:  # an irregular round thing: a radius that wanders around the circle
        r, cy = size / 2, base - size / 2
        angles = np.linspace(0, 2 * math.pi, 48, endpoint=False)
        wander = 0.88 + 0.25 * _noise(rng, 48, 1, 3)[0]
        radii = r * wander * (1 + 0.15 * np.sin(angles * int(rng.integers(3, 9))))  # lobes, as of petals
        d.polygon([(cx + q * math.cos(t), cy + q * math.sin(t)) for q, t in zip(radii, angles)], fill=255)
    return mask.filter(ImageFilter.GaussianBlur(1))


def _subject(rng, w: int, h: int) -> Image.Image:
    """One big, strongly coloured thing against the sky or a plain wall, as a photo frames a landmark,
    a car or a flower: shaded across, with fine structure (a lattice, as of girders or panels) and branches in
    front at times. Unlike a scene's objects it fills much of the picture and is never one flat colour."""
    if rng.random() < 0.6:
        top, low = np.array([rng.integers(20, 90), rng.integers(60, 140), rng.integers(150, 230)], np.float32), \
            np.array([rng.integers(120, 200), rng.integers(160, 220), rng.integers(200, 255)], np.float32)
        back = _between(top, low, np.broadcast_to(np.linspace(0, 1, h)[:, None], (h, w)))
    else:
        back = np.asarray(_texture(rng, w, h), np.float32) * rng.uniform(0.6, 1.0)
    hue = rng.uniform(0, 1)
    rgb = np.array(Image.new("HSV", (1, 1), (int(hue * 255), int(rng.integers(150, 256)), int(rng.integers(150, 256))))
                   .convert("RGB").getpixel((0, 0)), np.float32)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    turn = rng.uniform(0, 2 * math.pi)
    shade = 0.55 + 0.55 * ((xx / w) * math.cos(turn) + (yy / h) * math.sin(turn) + 1) / 2  # lit from one side
    period = rng.uniform(4, 14)
    grid = ((np.sin(xx / period + yy / (period * 1.7)) > 0.85) | (np.sin(yy / period) > 0.9)).astype(np.float32)
    thing = rgb * shade[..., None] * (1 - 0.45 * grid[..., None]) * (0.8 + 0.4 * _noise(rng, w, h, 4)[..., None])
    m = np.asarray(_silhouette(rng, w, h), np.float32)[..., None] / 255
    img = Image.fromarray(np.clip(back * (1 - m) + thing * m, 0, 255).astype(np.uint8))
    if rng.random() < 0.4:  # branches across a corner
        d = ImageDraw.Draw(img)
        x, y = (0, rng.uniform(0, 0.4) * h) if rng.random() < 0.5 else (w, rng.uniform(0, 0.4) * h)
        for _ in range(int(rng.integers(3, 8))):
            x2, y2 = x + rng.uniform(-0.3, 0.3) * w, y + rng.uniform(-0.1, 0.3) * h
            d.line((x, y, x2, y2), fill=(30, 25, 20), width=int(rng.integers(1, 4)))
            x, y = x2, y2
    return img


def photo_image(rng, w: int, h: int, kind: str | None = None) -> Image.Image:
    kind = kind or KINDS[int(rng.integers(len(KINDS)))]
    return {"texture": _texture, "street": _street, "still_life": _still_life, "close_up": _close_up,
            SUBJECT: _subject}[kind](rng, w, h)


class PhotoPicture(scenes.Picture):
    """A photo-like picture (``background['photo']`` seeds it, ``render`` says how it was saved),
    drawn at ``render['scale']`` times its processed size and resized to it."""

    def image(self) -> Image.Image:
        rng = np.random.default_rng(self.background["photo"])
        rd = self.render
        w, h = self.cols * scenes.CELL, self.rows * scenes.CELL
        scale = rd.get("scale", 1.0)
        img = photo_image(rng, max(16, round(w * scale)), max(16, round(h * scale)), self.background.get("kind"))
        img = img.resize((w, h), Image.BICUBIC)
        if rd.get("jpeg"):
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=rd["jpeg"])
            img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
        return img


def photo_item(seed: int, turns: int = 1, scale: float = 1.0, subject_share: float = 0.0) -> Item:
    """Photo-like media (one picture, sometimes two to four) asked any question of the scene types:
    answered UNKNOWN. Seeded on a stream of its own (key 57). ``subject_share`` of the pictures are
    a big subject instead (SUBJECT, from v3.1's step 8,500), drawn on a stream of their own (key 58), so
    that without it every item is what it was."""
    rng = np.random.default_rng([seed, 57, turns, round(scale * 1000)])
    swap = np.random.default_rng([seed, 58, turns])
    n = 1 if rng.random() < 0.75 else int(rng.integers(2, 5))
    pictures = []
    for _ in range(n):
        cols, rows = scenes._sides(rng, "single" if n == 1 else "images", scale)
        seed_of_photo, kind = int(rng.integers(2**31)), KINDS[int(rng.integers(len(KINDS)))]  # the draws' order as before
        pictures.append(PhotoPicture(cols, rows, {"photo": seed_of_photo,
                                                  "kind": SUBJECT if swap.random() < subject_share else kind},
                                     [], {"scale": float(rng.uniform(1.0, 2.5)),
                                          "jpeg": int(rng.integers(40, 95)) if rng.random() < 0.5 else 0}))
    shapes, colours = list(scenes.SHAPES), list(scenes.COLOURS)
    asks = [f"What colour is the {shapes[int(rng.integers(5))]}?", f"Which shape is {colours[int(rng.integers(6))]}?",
            "What is in the picture?", f"What colours are the {shapes[0]} and the {shapes[int(rng.integers(1, 5))]}?"]
    questions = [Question("unknown", asks[int(rng.integers(len(asks)))], scenes.UNKNOWN, ()) for _ in range(turns)]
    return Item("unknown", questions, pictures)


def held_out_photos(count: int, turns: int = 2, offset: int = 10_000_000, subject_share: float = 0.0) -> list[Item]:
    return [photo_item(offset + i, turns, subject_share=subject_share) for i in range(count)]
