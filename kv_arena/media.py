"""Reading images and videos from disk, with readable errors. Frames are decoded with decord
(no torchvision here) and sampled uniformly.

Images are bounded before they are decoded, so one upload cannot take the server's memory: more
than ``KV_ARENA_MAX_IMAGE_MB`` (default 30) bytes or ``KV_ARENA_MAX_IMAGE_PIXELS`` (default 25 M,
e.g. 5000 x 5000; read from the header) is refused with a message. An image within the limits but
above ``KV_ARENA_IMAGE_PIXELS`` (default 3584 x 3584 = 12.8 M, Qwen2-VL's ``max_pixels``, the
largest any supported processor keeps) is downscaled at load, keeping its aspect ratio (JPEGs
are decoded at a reduced scale); each model's processor then applies its own ``max_pixels`` or
resize, as it would have anyway.

One budget bounds what a message decodes, images and video frames together:
``KV_ARENA_MAX_DECODED_PIXELS`` (default 100 M, 300 MB of RGB), counted from the files' headers
before anything is decoded (:func:`decoded_pixels`; a video: the frames sampled x width x height)."""

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
MAX_DECODED_PIXELS = int(float(os.environ.get("KV_ARENA_MAX_DECODED_PIXELS", 100e6)))


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
        try:
            if self._reader is None:
                import decord

                self._reader = decord.VideoReader(self.path, ctx=decord.cpu(0))
            return self._reader.get_batch(index).asnumpy()
        except Exception as exc:  # decord raises its own DECORDError: a frame that does not decode
            raise UserError(f"'{os.path.basename(self.path)}' has frames that cannot be decoded: "
                            "it may be damaged or cut short; try another file.") from None


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
        raise UserError(f"'{name}' is not a readable image: {_image_trouble(exc)}.") from None


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


def _image_trouble(exc: BaseException) -> str:
    """What went wrong reading a picture, in words (never a Python class name)."""
    if isinstance(exc, Image.DecompressionBombError):
        return "it is too large to decode safely"
    if isinstance(exc, UnidentifiedImageError):
        return "its format is not one this app reads (PNG, JPEG, WebP, GIF, BMP...)"
    return "the file is damaged or cut short"


def _decord():
    """The video decoder, imported on first use: images need none, and the library (``pip install .``)
    installs it only with the app's extra."""
    try:
        import decord
    except ImportError:
        raise UserError('Reading videos needs decord: pip install decord (or pip install ".[app]").') from None
    return decord


def sampled_frames(total: int, num_frames: int) -> np.ndarray:
    """Which of a video's ``total`` frames :func:`load_video` takes for ``num_frames``: evenly spaced
    from the first to the last, each rounded to the nearest frame."""
    return np.linspace(0, total - 1, num=min(num_frames, total)).round().astype(int)


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
    decord = _decord()

    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0))
        total = len(reader)
        fps = float(reader.get_avg_fps()) or 1.0
    except Exception as exc:  # decord raises its own DECORDError and RuntimeError
        raise UserError(f"'{name}' is not a video that can be decoded: its format is unknown or the file is "
                        "damaged; try an .mp4 (H.264).") from None
    if total == 0:
        raise UserError(f"'{name}' has no frames.")
    if total / fps > MAX_VIDEO_SECONDS:
        raise UserError(f"'{name}' lasts {total / fps:.0f} s; the limit is {MAX_VIDEO_SECONDS:.0f} s.")
    index = sampled_frames(total, num_frames)
    try:
        height, width = reader[0].shape[:2]  # one frame: the size the codec really decodes to
        at_once = min(len(index), FramesOnDisk.BATCH) if lazy else len(index)
        # the header's size was checked with the message (decoded_pixels); a stream that decodes
        # larger than its container says is held to the same budget before the rest is decoded
        check_decoded_pixels([(at_once * width * height, f"{name}: {at_once} frames of {width} x {height}")])
        if lazy:
            frames = FramesOnDisk(path, list(index), height, width)
        else:
            frames = reader.get_batch(list(index)).asnumpy()
    except UserError:
        raise
    except Exception:  # DECORDError: the container opens, its frames do not decode
        raise UserError(f"'{name}' has frames that cannot be decoded: it may be damaged or cut short; "
                        "try another file.") from None
    return Video(frames=frames, timestamps=[float(i) / fps for i in index], fps=fps, source=path)


# --- what a file will decode to, from its header ---------------------------------------------------
def image_pixels(path: str) -> int:
    """Width x height from an image's header (0 if it has none: :func:`load_image` says so)."""
    try:
        with Image.open(path) as image:
            return image.size[0] * image.size[1]
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return 0


def video_frames(path: str, num_frames: int, lazy: bool) -> int:
    """How many frames :func:`load_video` decodes at once: the sampled ones (a lazy video: one
    batch); 0 if the container does not open (:func:`load_video` says so)."""
    decord = _decord()

    try:
        total = len(decord.VideoReader(path, ctx=decord.cpu(0)))
    except Exception:
        return 0
    sampled = min(max(num_frames, 1), total)
    return min(sampled, FramesOnDisk.BATCH) if lazy else sampled


def decoded_pixels(path: str, is_video: bool, num_frames: int = 8, lazy: bool = False) -> tuple[int, str]:
    """(pixels, in words) a file decodes to, read from its header without decoding anything."""
    name = os.path.basename(path) or path
    if not os.path.isfile(path):
        return 0, name
    if not is_video:
        return image_pixels(path), name
    size = video_size(path)
    frames = video_frames(path, num_frames, lazy) if size else 0
    if not size or not frames:
        return 0, name
    return frames * size[0] * size[1], f"{name}: {frames} frames of {size[0]} x {size[1]}"


def check_decoded_pixels(items: list[tuple[int, str]], limit: int | None = None) -> None:
    """A message's files together within the budget of decoded pixels, or a UserError that says it."""
    limit = MAX_DECODED_PIXELS if limit is None else limit
    total = sum(pixels for pixels, _ in items)
    if total > limit:
        said = "; ".join(words for pixels, words in items if pixels)
        raise UserError(f"This message would decode {total / 1e6:.1f} million pixels ({said}); the limit is "
                        f"{limit / 1e6:g} million pixels per message. Use fewer frames or smaller media.")


def video_size(path: str) -> tuple[int, int] | None:
    """(width, height) of a video from its container's header (AVI, MP4/MOV, Matroska/WebM, MPEG);
    None when it is none of those or says no size (:func:`load_video` then checks the size its
    first frame decodes to, before the others)."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            f.seek(0)
            if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
                return _avi_size(f.read(1 << 16))
            if head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"):
                return _mp4_size(f, os.path.getsize(path))
            if head[:4] == b"\x1a\x45\xdf\xa3":
                return _matroska_size(f.read(1 << 20))
            if head[:3] == b"\x00\x00\x01":  # MPEG-1/2 (program or elementary stream)
                return _mpeg_size(f.read(1 << 20))
    except (OSError, struct.error, ValueError):
        return None
    return None


def _avi_size(data: bytes) -> tuple[int, int] | None:
    """The largest size the AVI's main header and its video streams' formats declare."""
    sizes = []
    at = data.find(b"avih")
    if at >= 0:
        sizes.append(struct.unpack_from("<II", data, at + 8 + 32))
    at = data.find(b"strf")
    while at >= 0:
        width, height = struct.unpack_from("<ii", data, at + 8 + 4)
        sizes.append((abs(width), abs(height)))
        at = data.find(b"strf", at + 4)
    return max(sizes, key=lambda s: s[0] * s[1]) if sizes else None


def _mpeg_size(data: bytes) -> tuple[int, int] | None:
    """The size an MPEG-1/2 sequence header declares (12 bits each: at most 4095 x 4095)."""
    at = data.find(b"\x00\x00\x01\xb3")
    if at < 0 or at + 7 > len(data):
        return None
    width = (data[at + 4] << 4) | (data[at + 5] >> 4)
    height = ((data[at + 5] & 0x0F) << 8) | data[at + 6]
    return (width, height) if width and height else None


MP4_CONTAINERS = {b"moov", b"trak"}


def _mp4_size(f, end: int, start: int = 0, depth: int = 0) -> tuple[int, int] | None:
    """The largest track size (``tkhd``) in an ISO media file, walking its boxes without reading media."""
    best, at, boxes = None, start, 0
    while at + 8 <= end and boxes < 10_000 and depth < 4:
        f.seek(at)
        size, kind = struct.unpack(">I4s", f.read(8))
        header = 8
        if size == 1:
            size, header = struct.unpack(">Q", f.read(8))[0], 16
        elif size == 0:
            size = end - at
        if size < header:
            return best
        if kind in MP4_CONTAINERS:
            found = _mp4_size(f, at + size, at + header, depth + 1)
        elif kind == b"tkhd" and size >= header + 84:
            f.seek(at + size - 8)
            width, height = struct.unpack(">II", f.read(8))
            found = (width >> 16, height >> 16)
        else:
            found = None
        if found and (best is None or found[0] * found[1] > best[0] * best[1]):
            best = found
        at, boxes = at + size, boxes + 1
    return best


MATROSKA_MASTERS = {0x18538067, 0x1654AE6B, 0xAE, 0xE0}  # Segment, Tracks, TrackEntry, Video
MATROSKA_WIDTH, MATROSKA_HEIGHT, MATROSKA_CLUSTER = 0xB0, 0xBA, 0x1F43B675


def _vint(data: bytes, at: int, keep_marker: bool) -> tuple[int, int]:
    """An EBML variable-length integer at ``at``: (value, where the next field starts)."""
    first = data[at]
    length = 9 - first.bit_length() if first else 9
    if length > 8:
        raise ValueError("not an EBML number")
    value = first if keep_marker else first & (0xFF >> length)
    for byte in data[at + 1:at + length]:
        value = (value << 8) | byte
    return value, at + length


def _matroska_size(data: bytes) -> tuple[int, int] | None:
    """The largest PixelWidth x PixelHeight of the video tracks in a Matroska/WebM header."""
    at, width, height, best = 0, 0, 0, None
    while at < len(data) - 2:
        element, at = _vint(data, at, keep_marker=True)
        size, at = _vint(data, at, keep_marker=False)
        if element == MATROSKA_CLUSTER:
            break  # media from here on; the tracks came before
        if element in MATROSKA_MASTERS:
            continue  # step into it
        if element in (MATROSKA_WIDTH, MATROSKA_HEIGHT):
            value = int.from_bytes(data[at:at + size], "big")
            width, height = (value, height) if element == MATROSKA_WIDTH else (width, value)
            if width and height and (best is None or width * height > best[0] * best[1]):
                best = (width, height)
        at += size
    return best


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
