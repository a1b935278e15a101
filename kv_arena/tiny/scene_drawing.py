"""What a v3 picture is and how it is drawn: its objects (:class:`Thing`, geometry in fractions of the
picture), the picture's token grid (:class:`Picture`: which cells an object covers), its background
and the rendering that shifts it as a user's picture would be (resolution, resampling, JPEG).
The questions asked about such pictures are :mod:`.drawn_scenes`'."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CELL = 28  # px of one visual token (14 px patches merged 2x2) at the processed resolution
COLOURS = {"red": (215, 35, 35), "green": (30, 160, 50), "blue": (35, 75, 215), "yellow": (240, 200, 20),
           "purple": (140, 45, 170), "orange": (245, 125, 20)}
SHAPES = ("square", "circle", "triangle", "cross", "ring")
@dataclass(frozen=True)
class Thing:
    """One object: shape and colour name, centre (x, y) and side, all in fractions of the picture."""

    shape: str
    colour: str
    x: float
    y: float
    size: float
    # v3.1's drawing variations (scene_variations.py); the defaults draw v3's objects unchanged
    angle: float = 0.0  # degrees, turned about its centre (drawn shrunk to stay inside its box)
    stroke: float = 1.0  # the ring's line and the cross's arms, times v3's width
    outline: tuple | None = None  # a border of this colour around the shape
    rgb: tuple | None = None  # a shade of its colour (web orange for "orange") instead of COLOURS'


@dataclass
class Picture:
    """One image or video frame: its processed grid (cells), background and objects."""

    cols: int
    rows: int
    background: dict
    things: list[Thing] = field(default_factory=list)
    render: dict = field(default_factory=dict)  # resolution, resampling and JPEG of the drawing

    def cells_of(self, thing: Thing) -> list[int]:
        """Indices (row-major on this picture's grid) of the cells the object's box overlaps."""
        half = thing.size / 2
        c0, c1 = _span(thing.x - half * self.rows / self.cols, thing.x + half * self.rows / self.cols, self.cols)
        r0, r1 = _span(thing.y - half, thing.y + half, self.rows)
        return [r * self.cols + c for r in range(r0, r1) for c in range(c0, c1)]

    def core_of(self, thing: Thing) -> list[int]:
        """The cells whose centre lies inside the object's box (those that show its shape; a cell at
        its edge shows a corner of it), or the one cell under its centre for an object that holds none."""
        hx, hy = thing.size / 2 * self.rows / self.cols, thing.size / 2

        def held(k: int) -> bool:
            return (abs((k % self.cols + 0.5) / self.cols - thing.x) <= hx
                    and abs((k // self.cols + 0.5) / self.rows - thing.y) <= hy)

        centre = min(int(thing.y * self.rows), self.rows - 1) * self.cols + min(int(thing.x * self.cols), self.cols - 1)
        return [k for k in self.cells_of(thing) if held(k)] or [centre]

    def image(self) -> Image.Image:
        return draw(self)

    @property
    def token_count(self) -> int:
        return self.rows * self.cols


def _span(lo: float, hi: float, n: int) -> tuple[int, int]:
    """Cells [a, b) that the interval [lo, hi] (fractions) overlaps by more than 5% of a cell."""
    a = max(0, int(math.floor(lo * n + 0.05)))
    b = min(n, int(math.ceil(hi * n - 0.05)))
    return a, max(a + 1, b)


# --- drawing ----------------------------------------------------------------------------------------
def _jitter(rng, rgb, amount=22) -> tuple[int, int, int]:
    return tuple(int(np.clip(v + rng.integers(-amount, amount + 1), 0, 255)) for v in rgb)


def _far_from_objects(rgb) -> bool:
    """A background no object colour could be mistaken for."""
    return min(sum((a - b) ** 2 for a, b in zip(rgb, c)) for c in COLOURS.values()) > 70 ** 2


def background(rng) -> dict:
    """Any colour far enough from the object colours (greys, darks, pastels), and a texture."""
    while True:
        if rng.random() < 0.5:
            v = int(rng.integers(0, 256))
            base = _jitter(rng, (v, v, v), 12)
        else:
            base = tuple(int(v) for v in rng.integers(0, 256, 3))
        if _far_from_objects(base):
            break
    texture = ("plain", "noise", "dots", "lines", "checker", "gradient")[int(rng.integers(6))]
    return {"base": base, "texture": texture, "seed": int(rng.integers(2**31)), "strength": int(rng.integers(8, 26))}


def _paint_background(size: tuple[int, int], bg: dict) -> Image.Image:
    w, h = size
    base = np.array(bg["base"], np.float32)
    rng = np.random.default_rng(bg["seed"])
    s = bg["strength"]
    t = bg["texture"]
    img = np.broadcast_to(base, (h, w, 3)).copy()
    if t == "noise":
        img += rng.normal(0, s / 2, (h, w, 1))
    elif t == "gradient":
        img += np.linspace(-s, s, w, dtype=np.float32)[None, :, None] * rng.choice([-1, 1])
    elif t in ("dots", "lines", "checker"):
        period = max(4, int(min(w, h) / rng.uniform(12, 40)))
        yy, xx = np.mgrid[0:h, 0:w]
        if t == "dots":
            mark = ((yy % period) < period / 5) & ((xx % period) < period / 5)
        elif t == "lines":
            mark = ((xx + yy) % period) < max(1, period / 6)
        else:
            mark = ((yy // period + xx // period) % 2) == 1
        img[mark] -= s * np.sign(base.mean() - 128 + 0.5)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def _turned(points, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """``points`` turned by ``angle`` degrees about (cx, cy), shrunk to stay within r of it each way
    (a turned square's corners would reach into cells its box does not name)."""
    a = math.radians(angle)
    out = [(cx + (x - cx) * math.cos(a) - (y - cy) * math.sin(a), cy + (x - cx) * math.sin(a) + (y - cy) * math.cos(a))
           for x, y in points]
    reach = max(max(abs(x - cx), abs(y - cy)) for x, y in out)
    k = min(1.0, r / reach) if reach else 1.0
    return [(cx + (x - cx) * k, cy + (y - cy) * k) for x, y in out]


def _paint_thing(d: ImageDraw.ImageDraw, t: Thing, w: int, h: int, rgb) -> None:
    cx, cy, r = t.x * w, t.y * h, t.size * h / 2  # size is a fraction of the height; cells are square
    box = (cx - r, cy - r, cx + r, cy + r)
    edge = {} if t.outline is None else {"outline": tuple(t.outline), "width": max(1, round(0.14 * r))}
    if t.shape == "square":
        s = 0.85 * r
        points = [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    elif t.shape == "triangle":
        points = [(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)]
    elif t.shape == "cross":
        a = 0.28 * r * t.stroke
        points = [(cx - a, cy - r), (cx + a, cy - r), (cx + a, cy - a), (cx + r, cy - a), (cx + r, cy + a),
                  (cx + a, cy + a), (cx + a, cy + r), (cx - a, cy + r), (cx - a, cy + a), (cx - r, cy + a),
                  (cx - r, cy - a), (cx - a, cy - a)]
    if t.shape in ("square", "triangle", "cross"):
        if t.angle == 0 and t.outline is None:  # v3's own calls, pixel for pixel
            if t.shape == "square":
                d.rectangle((cx - 0.85 * r, cy - 0.85 * r, cx + 0.85 * r, cy + 0.85 * r), fill=rgb)
            elif t.shape == "triangle":
                d.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=rgb)
            else:
                d.rectangle((cx - r, cy - a, cx + r, cy + a), fill=rgb)
                d.rectangle((cx - a, cy - r, cx + a, cy + r), fill=rgb)
            return
        d.polygon(_turned(points, cx, cy, r, t.angle), fill=rgb, **edge)
    elif t.shape == "circle":
        d.ellipse(box, fill=rgb, **edge)
    else:  # ring
        line = max(2, round(0.32 * r * t.stroke))
        if t.outline is None:
            d.ellipse(box, outline=rgb, width=line)
        else:  # the border on both sides of the line
            d.ellipse(box, outline=tuple(t.outline), width=line + 2 * edge["width"])
            inset = edge["width"]
            d.ellipse((cx - r + inset, cy - r + inset, cx + r - inset, cy + r - inset), outline=rgb, width=line)


def draw(p: Picture) -> Image.Image:
    """The picture as a user's file would hold it: drawn at ``render['scale']`` times the processed
    size (so the processor, or our own resize, changes its resolution), ``render['jpeg']`` quality."""
    rd = p.render
    scale = rd.get("scale", 1.0)
    w, h = max(16, round(p.cols * CELL * scale)), max(16, round(p.rows * CELL * scale))
    img = _paint_background((w, h), p.background)
    d = ImageDraw.Draw(img)
    shade = np.random.default_rng(p.background["seed"] + 1)
    for t in p.things:
        # a named shade keeps close to itself: web orange jittered 25 would reach yellow's green
        amount = rd.get("colour_jitter", 0) if t.rgb is None else min(10, rd.get("colour_jitter", 0))
        _paint_thing(d, t, w, h, _jitter(shade, t.rgb or COLOURS[t.colour], amount))
    if rd.get("blur"):
        img = img.filter(ImageFilter.GaussianBlur(rd["blur"] * scale))
    if rd.get("resize_to"):
        img = img.resize(tuple(rd["resize_to"]), rd.get("resample", Image.BICUBIC))
    if rd.get("jpeg"):
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=rd["jpeg"])
        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return img


def rendering(rng, cols: int, rows: int, still: bool = True) -> dict:
    """How a picture reaches the model: drawn at 0.5-2.5x and resized to the processed size by the
    processor (out of bounds) or by us (a user's resize), sometimes blurred, sometimes JPEG."""
    out = {"colour_jitter": 25}
    if still:
        scale = float(np.exp(rng.uniform(np.log(0.5), np.log(2.5))))
        if max(cols, rows) * CELL * scale > 2400:
            scale = 2400 / (max(cols, rows) * CELL)
        out["scale"] = scale
        out["resize_to"] = (cols * CELL, rows * CELL)
        out["resample"] = (Image.NEAREST, Image.BILINEAR, Image.BICUBIC, Image.LANCZOS)[int(rng.integers(4))]
    if rng.random() < 0.2:
        out["blur"] = float(rng.uniform(0.3, 1.2))
    if rng.random() < 0.4:
        out["jpeg"] = int(rng.integers(30, 95))
    return out
