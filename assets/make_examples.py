"""Make the app's example media: three small pictures and a two-second video, all drawn here so
they carry no licence and work offline.

    python -m assets.make_examples          # from the checkout's root; needs Pillow; the video also PyAV (pip install av)

Writes shapes.png, chart.png, street.png, bouncing_ball.mp4 (H.264, so
browsers play it) and the examples of the generation of tiny-arena-vl the app serves (v2's
arena_*.png, arena_moving.mp4; v3's scene_*.png, scene_moving.mp4) next to this file; the README's
screenshot is taken by tests/test_app_browser.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).resolve().parent
SIZE = 448  # 256 visual tokens for Qwen2-VL: the numbers in the About tab


def shapes() -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), "white")
    d = ImageDraw.Draw(image)
    d.ellipse((40, 50, 190, 200), fill="#d62828")
    d.rectangle((250, 60, 400, 210), fill="#1d4e89")
    d.polygon([(130, 400), (60, 260), (200, 260)], fill="#2a9d8f")
    d.regular_polygon((320, 330, 80), n_sides=5, rotation=18, fill="#f4a261")
    return image


def chart() -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), "white")
    d = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=20)
    d.line((50, 390, 420, 390), fill="black", width=3)
    d.line((50, 390, 50, 40), fill="black", width=3)
    for i, (label, height, color) in enumerate([("A", 120, "#264653"), ("B", 300, "#e76f51"),
                                                ("C", 190, "#2a9d8f"), ("D", 80, "#e9c46a")]):
        left = 80 + i * 85
        d.rectangle((left, 390 - height, left + 55, 388), fill=color)
        d.text((left + 20, 400), label, fill="black", font=font)
    d.text((150, 10), "Sales per shop", fill="black", font=font)
    return image


def street() -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), "#9ad1f5")
    d = ImageDraw.Draw(image)
    d.ellipse((340, 30, 410, 100), fill="#ffd23f")
    d.rectangle((0, 300, SIZE, SIZE), fill="#6c757d")
    d.rectangle((0, 290, SIZE, 300), fill="#adb5bd")
    for x in range(20, SIZE, 90):
        d.rectangle((x, 365, x + 50, 372), fill="white")
    d.rectangle((60, 170, 210, 290), fill="#b5651d")
    d.polygon([(45, 170), (135, 95), (225, 170)], fill="#7f2d1b")
    d.rectangle((120, 230, 150, 290), fill="#3d2b1f")
    d.rectangle((290, 200, 305, 290), fill="#5a3e2b")
    d.ellipse((255, 130, 340, 215), fill="#2d6a4f")
    return image


def bouncing_ball(frames: int = 16, fps: int = 8, size: int = 224) -> list[np.ndarray]:
    """A red ball crossing a striped floor left to right, bouncing once."""
    out = []
    for i in range(frames):
        t = i / (frames - 1)
        image = Image.new("RGB", (size, size), "#f1faee")
        d = ImageDraw.Draw(image)
        d.rectangle((0, 180, size, size), fill="#a8dadc")
        x = 20 + t * (size - 40)
        y = 170 - 130 * abs(np.sin(np.pi * t))
        d.ellipse((x - 16, y - 16, x + 16, y + 16), fill="#e63946")
        out.append(np.asarray(image))
    return out


def write_mp4(path: Path, frames: list[np.ndarray], fps: int = 8, crf: int = 30) -> None:
    """H.264 (yuv420p, so browsers play it); ``crf`` 0 is lossless apart from the chroma subsampling."""
    import av  # only this script needs it

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryslow", "movflags": "+faststart"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def arena_examples() -> list[Path]:
    """The served tiny-arena-vl's example of each question type (``examples()`` of its generation's
    scenes, kv_arena/tiny/generations.py), drawn as the model reads them; a video at its own frame rate."""
    from kv_arena.tiny import generations

    written = []
    generation = generations.of()
    made = list(generation.scenes.examples().values()) + ([generation.long_example()] if generation.long_example else [])
    for it, files in made:
        if it.video:
            write_mp4(HERE / files[0], list(it.frames()), fps=round(it.fps), crf=0)
        else:
            for picture, name in zip(it.pictures, files):
                picture.image().save(HERE / name, optimize=True)
        written += [HERE / name for name in files]
    return written


def main() -> None:
    for name, make in (("shapes", shapes), ("chart", chart), ("street", street)):
        make().save(HERE / f"{name}.png", optimize=True)
    write_mp4(HERE / "bouncing_ball.mp4", bouncing_ball())
    arena = arena_examples()
    for path in sorted(HERE.glob("*.png")) + [HERE / "bouncing_ball.mp4"] + [p for p in arena if p.suffix == ".mp4"]:
        print(f"{path.name}: {path.stat().st_size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
