"""Reading images and videos from disk, with readable errors. Frames are decoded with decord
(no torchvision here) and sampled uniformly.

Images are bounded before they are decoded, so one upload cannot take the server's memory: more
than ``KV_ARENA_MAX_IMAGE_MB`` (default 30) bytes or ``KV_ARENA_MAX_IMAGE_PIXELS`` (default 25 M,
e.g. 5000 x 5000; read from the header) is refused with a message. An image within the limits but
above ``KV_ARENA_IMAGE_PIXELS`` (default 3584 x 3584 = 12.8 M, Qwen2-VL's ``max_pixels``, the
largest any supported processor keeps) is downscaled at load, keeping its aspect ratio (JPEGs
are decoded at a reduced scale); each model's processor then applies its own ``max_pixels`` or
resize, as it would have anyway."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import UserError

MAX_VIDEO_SECONDS = float(os.environ.get("KV_ARENA_MAX_VIDEO_SECONDS", 600))
MAX_VIDEO_BYTES = int(float(os.environ.get("KV_ARENA_MAX_VIDEO_MB", 200)) * 2**20)
MAX_IMAGE_BYTES = int(float(os.environ.get("KV_ARENA_MAX_IMAGE_MB", 30)) * 2**20)
MAX_IMAGE_PIXELS = int(float(os.environ.get("KV_ARENA_MAX_IMAGE_PIXELS", 25e6)))
LOAD_PIXELS = int(float(os.environ.get("KV_ARENA_IMAGE_PIXELS", 3584 * 3584)))


class FramesOnDisk:
    """A video file's sampled frames, decoded when they are read: a long video streamed a few frames
    at a time holds one chunk of decoded frames, never the whole clip. Reads as the (N, H, W, 3)
    uint8 array it stands for: ``len``, ``shape``, an index or a slice (decoded then), iteration (a
    batch at a time) and ``np.asarray`` (every frame). Pickles as the path and the frame indices."""

    dtype = np.dtype(np.uint8)
    ndim = 4
    BATCH = 16  # frames decoded at once while iterating

    def __init__(self, path: str, index: list[int], height: int, width: int):
        self.path, self.index = path, [int(i) for i in index]
        self.shape = (len(self.index), height, width, 3)
        self._reader = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._decode(self.index[key])
        if isinstance(key, (int, np.integer)):
            return self._decode([self.index[key]])[0]
        return np.asarray(self)[key]

    def __iter__(self):
        for first in range(0, len(self), self.BATCH):
            yield from self[first:first + self.BATCH]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        frames = self._decode(self.index)
        return frames if dtype is None else frames.astype(dtype)

    def tobytes(self) -> bytes:
        return np.asarray(self).tobytes()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None}  # a decoder does not cross processes; it opens again

    def _decode(self, index: list[int]) -> np.ndarray:
        if not index:
            return np.empty((0,) + self.shape[1:], dtype=np.uint8)
        if self._reader is None:
            import decord

            self._reader = decord.VideoReader(self.path, ctx=decord.cpu(0))
        return self._reader.get_batch(index).asnumpy()


@dataclass
class Video:
    """Uniformly sampled RGB frames (N, H, W, 3) uint8 with the times they were taken at: an array,
    or :class:`FramesOnDisk` for a video decoded as it is read."""

    frames: np.ndarray | FramesOnDisk
    timestamps: list[float]
    fps: float
    source: str = ""

    @property
    def sample_fps(self) -> float:
        """Frames per second of the sampled clip (what M-RoPE's temporal ids are spaced by)."""
        if len(self.timestamps) < 2:
            return 1.0
        span = self.timestamps[-1] - self.timestamps[0]
        return (len(self.timestamps) - 1) / span if span > 0 else 1.0


def load_image(source) -> Image.Image:
    """A path or PIL image -> RGB PIL image of at most ``LOAD_PIXELS`` pixels; raises UserError when
    it is not an image or is over the limits (checked before decoding)."""
    if isinstance(source, Image.Image):
        return bounded(source.convert("RGB"))
    path = str(source)
    name = os.path.basename(path) or path
    if not os.path.isfile(path):
        raise UserError(f"Image not found: {name}")
    if os.path.getsize(path) > MAX_IMAGE_BYTES:
        raise UserError(f"'{name}' is larger than the {MAX_IMAGE_BYTES / 2**20:g} MB this app accepts for an image.")
    try:
        with Image.open(path) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise UserError(f"'{name}' is {width} x {height} pixels; the limit is "
                                f"{MAX_IMAGE_PIXELS / 1e6:g} million pixels. Downscale it and attach it again.")
            if getattr(image, "n_frames", 1) > 1:  # reading its first frame alone would answer about a still
                raise UserError(f"'{name}' is an animation of {image.n_frames} frames: attach it as a video "
                                "(.mp4) or as a still image.")
            image.draft("RGB", fitted(width, height))  # JPEG: decode at a reduced scale (no-op otherwise)
            image.load()
            return bounded(image.convert("RGB"))
    except UserError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise UserError(f"'{name}' is not a readable image ({exc.__class__.__name__}).") from None


def fitted(width: int, height: int, pixels: int | None = None) -> tuple[int, int]:
    """The size with at most ``pixels`` (default ``LOAD_PIXELS``) pixels and the same aspect ratio."""
    pixels = LOAD_PIXELS if pixels is None else pixels
    if width * height <= pixels:
        return width, height
    scale = (pixels / (width * height)) ** 0.5
    return max(1, int(width * scale)), max(1, int(height * scale))


def bounded(image: Image.Image) -> Image.Image:
    size = fitted(*image.size)
    return image if size == image.size else image.resize(size, Image.BICUBIC)


def load_video(source, num_frames: int = 8, lazy: bool = False) -> Video:
    """Sample ``num_frames`` frames uniformly from a video file; UserError if it is not one.
    ``lazy``: the frames are checked now and decoded when read (:class:`FramesOnDisk`)."""
    if isinstance(source, Video):
        return source
    path = str(source)
    name = os.path.basename(path)
    if num_frames < 1:
        raise UserError("The number of video frames must be at least 1.")
    if not os.path.isfile(path):
        raise UserError(f"Video not found: {name or path}")
    if os.path.getsize(path) > MAX_VIDEO_BYTES:
        raise UserError(f"'{name}' is larger than the {MAX_VIDEO_BYTES // 2**20} MB this app accepts.")
    import decord  # imported here: decoding is optional for image-only use

    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0))
        total = len(reader)
        fps = float(reader.get_avg_fps()) or 1.0
    except Exception as exc:  # decord raises its own DECORDError and RuntimeError
        raise UserError(f"'{name}' is not a video that can be decoded ({exc.__class__.__name__}).") from None
    if total == 0:
        raise UserError(f"'{name}' has no frames.")
    if total / fps > MAX_VIDEO_SECONDS:
        raise UserError(f"'{name}' lasts {total / fps:.0f} s; the limit is {MAX_VIDEO_SECONDS:.0f} s.")
    index = np.linspace(0, total - 1, num=min(num_frames, total)).round().astype(int)
    if lazy:
        height, width = reader[0].shape[:2]
        frames = FramesOnDisk(path, list(index), height, width)
    else:
        frames = reader.get_batch(list(index)).asnumpy()
    return Video(frames=frames, timestamps=[float(i) / fps for i in index], fps=fps, source=path)


def _riff(tag: bytes, data: bytes) -> bytes:
    return tag + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")


def _riff_list(kind: bytes, body: bytes) -> bytes:
    return b"LIST" + struct.pack("<I", len(body) + 4) + kind + body


def write_avi(path, frames: np.ndarray, fps: int = 2) -> None:
    """Frames (N, H, W, 3) uint8 -> an uncompressed AVI (24-bit DIB frames), pixel for pixel, which
    :func:`load_video` reads back exactly; written by hand so no encoder package is needed (the
    app's drawn scenes; browsers do not preview it, the model reads it)."""
    n, h, w, _ = frames.shape
    size = w * h * 3
    avih = struct.pack("<14I", 1_000_000 // fps, size * fps, 0, 0x10, n, 0, 1, size, w, h, 0, 0, 0, 0)
    strh = b"vidsDIB " + struct.pack("<IHHIIIIIIIIhhhh", 0, 0, 0, 0, 1, fps, 0, n, size, 0xFFFFFFFF, 0, 0, 0, w, h)
    strf = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, size, 0, 0, 0, 0)  # BITMAPINFOHEADER
    header = _riff_list(b"hdrl", _riff(b"avih", avih) + _riff_list(b"strl", _riff(b"strh", strh) + _riff(b"strf", strf)))
    chunks, index, offset = [], [], 4
    for frame in frames:
        data = np.ascontiguousarray(frame[::-1, :, ::-1]).tobytes()  # a DIB is bottom-up BGR
        chunks.append(_riff(b"00db", data))
        index.append(b"00db" + struct.pack("<III", 0x10, offset, len(data)))
        offset += len(chunks[-1])
    body = b"AVI " + header + _riff_list(b"movi", b"".join(chunks)) + _riff(b"idx1", b"".join(index))
    with open(path, "wb") as out:
        out.write(b"RIFF" + struct.pack("<I", len(body)) + body)
