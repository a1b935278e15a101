"""What a turn takes: the controls' :class:`Settings` and a user message, decoded and checked
(:class:`Prepared`) before any model work; and the video frames a model takes by default
(:func:`default_frames`)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from kv_arena import backends
from kv_arena.backends.params import BUDGET
from kv_arena.backends.stack import params_owner

from ..errors import UserError
from ..media import check_decoded_pixels, decoded_pixels, load_image, load_video
from ..runtime.inputs import Message
from ..runtime.models import DEFAULT_MODEL
from ..tiny import generations
from .model_picker import is_trained_here
from .model_pool import Progress, silent
from .uploads import file_hash

VIDEO_SUFFIXES = {".mp4", ".webm", ".mov", ".avi", ".mkv", ".m4v", ".mpg", ".mpeg"}
MAX_FRAMES = 32  # a video prefilled in one prompt
DEFAULT_FRAMES = 8  # frames sampled from a video by default (the trained model's: default_frames)
MAX_STREAMED_FRAMES = 1024  # a video streamed under a cap: the cache stays under it whatever the length
MB = 2**20
# a message's text: far above any question about a picture, far below what costs the server a minute
MAX_TEXT_CHARS = int(os.environ.get("KV_ARENA_MAX_TEXT_CHARS", 20_000))
MAX_TEXT_BYTES = int(os.environ.get("KV_ARENA_MAX_TEXT_BYTES", 64 * 1024))


def default_frames(model) -> int:
    """The frames sampled from a video by default for ``model``. The trained model's generation needs
    every frame of its videos (a video token merges two neighbouring frames, and its moving object
    moves inside them: frames sampled further apart show it another motion), so it takes as many as
    its longest video has (a shorter one comes back whole: :func:`~kv_arena.media.load_video`).
    Every other model, hub or random, takes :data:`DEFAULT_FRAMES`, its memory as before; so does a
    generation this engine does not know (the model says why it cannot load when it is used)."""
    if not isinstance(model, str) or not is_trained_here(model):
        return DEFAULT_FRAMES
    try:
        return min(generations.of().video_frames, MAX_FRAMES)
    except UserError:
        return DEFAULT_FRAMES


@dataclass(frozen=True)
class Settings:
    """Everything the controls decide. ``params`` holds every method's values, so a comparison
    runs each method as configured; use :meth:`make` to build it from a dict."""

    model: str = DEFAULT_MODEL
    method: str = field(default_factory=backends.reference_name)
    budget: float = BUDGET.default
    max_new_tokens: int = 48
    num_frames: int = DEFAULT_FRAMES
    temperature: float = 0.0
    question_after: bool = False  # the media prefilled and compressed first, then the question
    stream_cap_mb: float = 0.0  # > 0: a message's media streamed in chunks under this KV cap (0: one prompt)
    params: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()  # (method, ((name, value), ...))

    @classmethod
    def make(cls, params: dict[str, dict] | None = None, **fields) -> Settings:
        frozen = tuple((m, tuple(sorted(v.items()))) for m, v in sorted((params or {}).items()))
        return cls(params=frozen, **fields)

    def method_params(self, method: str) -> dict:
        """The parameters set for ``method`` (a stack's are its selector's: snapkv+fp8 takes SnapKV's)."""
        return dict(dict(self.params).get(params_owner(method), ()))

    @property
    def streamed(self) -> bool:
        return self.stream_cap_mb > 0

    @property
    def cap_bytes(self) -> int | None:
        """The KV cap a streamed message's media go in under (None: not streamed)."""
        return int(self.stream_cap_mb * MB) if self.streamed else None

    @property
    def cache_key(self) -> tuple:
        """What built the chat's cache: a change here means the cache cannot be continued."""
        return (self.model, self.method, self.budget, tuple(sorted(self.method_params(self.method).items())),
                self.stream_cap_mb)

    @property
    def generation(self) -> tuple:
        """What else, besides the messages, decides the answer (part of a reference's key)."""
        return self.model, self.max_new_tokens, self.temperature, self.question_after


@dataclass
class Prepared:
    """One user message, decoded and checked before any model work."""

    message: Message
    key: str  # content hash: same text, same media bytes, same frame count -> same key
    files: list[str] = field(default_factory=list)
    media: str = ""  # content hash of the media alone (which scene it shows; "" without media)


def checked_text(text: str) -> str:
    """Text a message may hold: at most MAX_TEXT_CHARS characters and MAX_TEXT_BYTES bytes (checked
    before anything is encoded or tokenised: one 60 MB message once held the queue for minutes), valid
    Unicode (a lone surrogate, which JSON lets a client send, cannot be encoded, tokenised or shown
    back), or a UserError. Messages, follow-ups and every message of a history sent back pass here."""
    if len(text) > MAX_TEXT_CHARS:
        raise UserError(f"The message is too long: {len(text):,} characters, more than {MAX_TEXT_CHARS:,} "
                        "(KV_ARENA_MAX_TEXT_CHARS). Shorten it.")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise UserError(f"The message holds a character that is not valid text (U+{ord(text[exc.start]):04X} at "
                        f"position {exc.start}, a lone surrogate); type it again.") from None
    if size > MAX_TEXT_BYTES:
        raise UserError(f"The message is too long: {size:,} bytes of UTF-8, more than {MAX_TEXT_BYTES:,} "
                        "(KV_ARENA_MAX_TEXT_BYTES). Shorten it.")
    return text


def prepare(text: str, files: list, num_frames: int = DEFAULT_FRAMES, progress: Progress = silent) -> Prepared:
    """Decode the attached images and videos; any bad file raises a UserError naming it."""
    text = checked_text(text or "").strip()
    files = [str(f) for f in files or []]
    if not text and not files:
        raise UserError("The message is empty: type a question or attach an image or a video.")
    digest = hashlib.sha1(f"{text}\x00{num_frames}".encode())
    media = hashlib.sha1()
    images, videos = [], []
    lazy = num_frames > MAX_FRAMES  # more frames than one prompt takes only ever stream, a chunk at a time
    # one budget of decoded pixels for the whole message, from the headers, before anything is decoded
    check_decoded_pixels([decoded_pixels(path, is_video(path), num_frames, lazy) for path in files])
    for i, path in enumerate(files):
        progress(0.05 + 0.2 * i / len(files), f"Reading {Path(path).name}...")
        if is_video(path):
            videos.append(load_video(path, num_frames, lazy=lazy))
        else:  # anything else must be an image; load_image says so readably when it is not
            images.append(load_image(path))
        content = file_hash(path).encode()
        digest.update(content)
        media.update(content)
    message = Message(text, images=images, videos=videos, num_frames=num_frames)
    return Prepared(message, digest.hexdigest(), files, media.hexdigest() if files else "")


def is_video(path: str) -> bool:
    return Path(path).suffix.lower() in VIDEO_SUFFIXES


def first_frame(path: str, side: int = 160) -> Image.Image:
    """A video's first frame, at most ``side`` px a side: its still preview (a browser that loads
    no video until it is played shows nothing); a UserError as for any video that does not decode."""
    frame = Image.fromarray(np.asarray(load_video(path, num_frames=1).frames[0], np.uint8))
    frame.thumbnail((side, side))
    return frame


def request_seconds(settings: Settings, prepared: Prepared, runs: int = 1) -> float:
    """How long the GPU may take for ``runs`` answers to this message: a start, each image or
    video frame encoded, each new token (generous for a 2B model on a ZeroGPU slice)."""
    message = prepared.message
    media = len(message.images) + sum(len(getattr(v, "frames", ())) or message.num_frames for v in message.videos)
    return 15 + runs * (3 + 1.5 * media + 0.25 * settings.max_new_tokens)
