"""From chat messages to model inputs, one turn (a "chunk") at a time.

Each architecture family gets an adapter that knows its chat markers, how to turn an image or a
video into pixels and placeholder tokens, and its rotary positions (1-D, or M-RoPE for Qwen-VL).
Every chunk also yields a :class:`PromptLayout` (system prompt, each image, each video frame,
text spans, post-vision text) in absolute token indices: every backend receives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from PIL import Image

from kv_arena.backends.layout import PromptLayout, VisualSpan

from ..media import Video, load_image, load_video
from .mrope_positions import model_positions

DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass
class Message:
    """One user turn: text plus any number of images and videos (paths, PIL images or Video)."""

    text: str = ""
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    num_frames: int = 8
    media_first: bool = True  # images/videos before the text, as the usual chat templates do


@dataclass
class Chunk:
    """The tokens of one prefill, ready for the model."""

    input_ids: torch.Tensor  # (1, q)
    rope_ids: torch.Tensor  # (P, q) rotary position ids
    layout: PromptLayout
    model_kwargs: dict  # pixel_values, image_grid_thw, ...
    next_position: int  # rotary position of the token after this chunk


class _Builder:
    """Accumulates ids, spans and pixels for one chunk."""

    def __init__(self, start: int):
        self.start = start
        self.ids: list[int] = []
        self.visuals: list[VisualSpan] = []
        self.text: list[tuple[int, int]] = []
        self.system: tuple[int, int] | None = None

    @property
    def here(self) -> int:
        return self.start + len(self.ids)

    def add_text(self, ids: list[int], system: bool = False) -> None:
        if not ids:
            return
        span = (self.here, self.here + len(ids))
        self.ids.extend(ids)
        if system:
            self.system = span
        else:
            self.text.append(span)

    def add_visual(self, kind: str, ids: list[int], grid=None, frames=None) -> None:
        span = (self.here, self.here + len(ids))
        self.ids.extend(ids)
        self.visuals.append(VisualSpan(kind, span, frames or [], grid))

    def layout(self) -> PromptLayout:
        return PromptLayout(self.start, self.here, self.system, self.visuals, self.text)


class ChatAdapter:
    """Base adapter: text markers and 1-D positions. Subclasses handle pixels."""

    rope_dims = 1
    # How a video can be prefilled in parts with the positions of one prompt (kv_arena/runtime/streaming):
    # "frames" (a video is its frames as images), "groups" (native video: whole temporal groups), or
    # None (not yet: the video's layout interleaves text the streaming code does not rebuild).
    video_chunking: str | None = "frames"
    system_open = system_close = ""
    user_open = user_close = ""
    assistant_open = ""
    assistant_close = ""  # text appended after the end-of-turn token when a turn ends
    image_placeholder = ""  # text marker of one image inside the processor's own template

    def __init__(self, model, tokenizer, image_processor, processor=None):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.processor = processor
        self.config = model.config

    # --- tokens --------------------------------------------------------------------------------
    def tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    @property
    def eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = self.config.get_text_config().eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
        return {i for i in ids if i is not None}

    def end_of_turn_ids(self) -> list[int]:
        """Fed after an answer that stopped without its end-of-turn token (max tokens, stop)."""
        return [self.tokenizer.eos_token_id] + self.tokens(self.assistant_close)

    def bos_ids(self) -> list[int]:
        bos = self.tokenizer.bos_token_id
        return [bos] if bos is not None and self.tokenizer.bos_token is not None and self.rope_dims == 1 else []

    # --- turns ---------------------------------------------------------------------------------
    def encode_turn(self, message: Message, start: int, next_position: int, system: str | None,
                    prefix_ids: list[int] = (), open_turn: bool = True, close_turn: bool = True,
                    media_scale: float = 1.0) -> Chunk:
        """Tokens of one user turn and the assistant header. ``system`` only on the first turn;
        ``open_turn`` / ``close_turn`` False split a turn in two chunks (media first, question later);
        ``media_scale`` < 1: every picture and video frame resized first so that it makes that share
        of the visual tokens (:meth:`scaled_size`; a method that ``resizes_media``)."""
        b = _Builder(start)
        pixels: dict[str, list] = {}
        if prefix_ids:  # unfed end of the previous answer
            b.add_text(list(prefix_ids))
        if system is not None:
            b.add_text(self.bos_ids() + self.tokens(self.system_open + system + self.system_close), system=True)
        if open_turn:
            b.add_text(self.tokens(self.user_open))
        images = [load_image(i) for i in message.images]
        videos = [load_video(v, message.num_frames) for v in message.videos]
        if media_scale < 1:
            images, videos = self.scaled_media(images, videos, media_scale)
        if not message.media_first:
            b.add_text(self.tokens(message.text))
        for image in images:
            self.add_image(b, image, pixels)
        for video in videos:
            self.add_video(b, video, pixels)
        if message.media_first:
            b.add_text(self.tokens(("\n" if images or videos else "") + message.text))
        if close_turn:
            b.add_text(self.tokens(self.user_close + self.assistant_open))
        ids = torch.tensor([b.ids], dtype=torch.long)
        rope_ids, next_pos = self.positions(ids, b, pixels, next_position)
        return Chunk(ids, rope_ids, b.layout(), self.pack_pixels(pixels), next_pos)

    # --- media resized before the vision tower (a method that ``resizes_media``) ---------------------
    # whether a smaller picture makes fewer visual tokens: False where the processor sizes every
    # picture to one fixed grid (LLaVA's 336 px crop), which a method that resizes media cannot change
    resizable = False

    def scaled_size(self, height: int, width: int, scale: float, max_pixels: int | None = None) -> tuple[int, int]:
        """(h, w) in pixels a picture of ``height`` x ``width`` is resized to so that it makes the
        ``scale`` share of the visual tokens the processor would make of it (``max_pixels``: the
        processor's pixel budget for it, a video frame's)."""
        raise NotImplementedError(f"{type(self).__name__} sizes every picture to a fixed grid")

    def scaled_media(self, images: list[Image.Image], videos: list[Video], scale: float):
        """``images`` and ``videos`` resized to :meth:`scaled_size` (bicubic, as the processors
        resize), as a smaller upload would be: the processor then takes them as they are."""
        from ..errors import UserError

        if not self.resizable:
            raise UserError(f"This {self.config.model_type} model's processor sizes every picture to a fixed grid: "
                            "a smaller picture makes as many visual tokens.")
        resized = []
        for image in images:
            h, w = self.scaled_size(image.height, image.width, scale)
            resized.append(image if (w, h) == image.size else image.resize((w, h), Image.BICUBIC))
        clips = []
        for video in videos:
            n, height, width = video.frames.shape[:3]
            h, w = self.scaled_size(height, width, scale, self.video_frame_pixels(n))
            frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC)) for f in video.frames])
            clips.append(replace(video, frames=frames))
        return resized, clips

    # --- overridable ---------------------------------------------------------------------------
    def positions(self, ids: torch.Tensor, b: _Builder, pixels: dict, next_position: int):
        q = ids.shape[1]
        return torch.arange(next_position, next_position + q).view(1, q), next_position + q

    def add_image(self, b: _Builder, image: Image.Image, pixels: dict) -> None:
        raise NotImplementedError

    def add_video(self, b: _Builder, video: Video, pixels: dict) -> None:
        """Models without a video path see the sampled frames as images, one span per frame."""
        first = len(b.visuals)
        for frame in video.frames:
            self.add_image(b, Image.fromarray(frame), pixels)
        frames = b.visuals[first:]
        del b.visuals[first:]
        b.visuals.append(VisualSpan("video", (frames[0].span[0], frames[-1].span[1]), [f.span for f in frames],
                                    (len(frames),) + tuple(frames[0].grid[1:]) if frames[0].grid else None))

    def video_frame_pixels(self, num_frames: int) -> int | None:
        """The pixel budget of each frame of a ``num_frames`` video in one prompt; None: each frame
        is an image, sized as one."""
        return None

    def pack_pixels(self, pixels: dict) -> dict:
        return {k: torch.cat(v) if isinstance(v[0], torch.Tensor) else v for k, v in pixels.items()}

    def image_tokens(self, count: int) -> list[int]:
        return [self.config.image_token_id] * count


class QwenVLAdapter(ChatAdapter):
    """Qwen2-VL / Qwen2.5-VL: ChatML markers, native video, M-RoPE (3 position components)."""

    rope_dims = 3
    video_chunking = "groups"
    resizable = True  # smart_resize keeps any size on the patch grid between min and max pixels
    system_open, system_close = "<|im_start|>system\n", "<|im_end|>\n"
    user_open, user_close = "<|im_start|>user\n", "<|im_end|>\n"
    assistant_open, assistant_close = "<|im_start|>assistant\n", "\n"

    def add_image(self, b, image, pixels) -> None:
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"][0]
        merge = self.image_processor.merge_size
        count = int(grid.prod()) // merge**2
        b.add_text([self.config.vision_start_token_id])
        b.add_visual("image", self.image_tokens(count), grid=(1, int(grid[1]) // merge, int(grid[2]) // merge))
        b.add_text([self.config.vision_end_token_id])
        pixels.setdefault("pixel_values", []).append(out["pixel_values"])
        pixels.setdefault("image_grid_thw", []).append(out["image_grid_thw"])

    def add_video(self, b, video, pixels) -> None:
        patches, grid = self.patchify_video(video.frames)
        merge = self.image_processor.merge_size
        t, h, w = grid
        per_frame = (h // merge) * (w // merge)
        b.add_text([self.config.vision_start_token_id])
        start = b.here
        frames = [(start + i * per_frame, start + (i + 1) * per_frame) for i in range(t)]
        b.add_visual("video", [self.config.video_token_id] * (t * per_frame), grid=(t, h // merge, w // merge), frames=frames)
        b.add_text([self.config.vision_end_token_id])
        pixels.setdefault("pixel_values_videos", []).append(patches)
        for key, value in self.video_grid_inputs(video, grid).items():
            pixels.setdefault(key, []).append(value)

    def video_grid_inputs(self, video: Video, grid: tuple[int, int, int]) -> dict[str, torch.Tensor]:
        """What the rotary positions of a video of ``grid`` (t, h, w in patches) are computed from."""
        inputs = {"video_grid_thw": torch.tensor([grid])}
        if self.config.model_type == "qwen2_5_vl":
            tp = self.image_processor.temporal_patch_size
            inputs["second_per_grid_ts"] = torch.tensor([tp / video.sample_fps])
        return inputs

    def video_frame_pixels(self, num_frames: int) -> int:
        """The pixel budget of each frame of a ``num_frames`` video in one prompt: the video shares
        one image's budget among its temporal groups."""
        ip = self.image_processor
        groups = -(-num_frames // ip.temporal_patch_size)
        return max(56 * 56, ip.size["longest_edge"] // max(1, groups))

    def video_frame_size(self, num_frames: int, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
        """(h, w) in pixels each frame of a video is resized to. By default a video shares one
        image's pixel budget among its temporal groups; ``max_pixels`` fixes it per frame instead
        (a streamed video, whose length does not shrink its frames)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        max_pixels = max_pixels or self.video_frame_pixels(num_frames)
        return smart_resize(height, width, factor=ip.patch_size * ip.merge_size, min_pixels=ip.size["shortest_edge"],
                            max_pixels=max_pixels)

    def scaled_size(self, height: int, width: int, scale: float, max_pixels: int | None = None) -> tuple[int, int]:
        """The processor's own size for the picture (``smart_resize``: sides on the patch x merge grid,
        aspect kept, between its min and max pixels), then the largest such size with at most
        ``scale`` of its pixels, so at most that share of its visual tokens (never under the
        processor's min pixels)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        factor, low = ip.patch_size * ip.merge_size, ip.size["shortest_edge"]
        h, w = smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=max_pixels or ip.size["longest_edge"])
        small = smart_resize(h, w, factor=factor, min_pixels=low, max_pixels=max(low, int(scale * h * w)))
        if small[0] * small[1] < low:  # rounded down under the min pixels: the processor would size it up
            small = smart_resize(*small, factor=factor, min_pixels=low, max_pixels=h * w)
        return small

    def patchify_video(self, frames: np.ndarray, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Frames (N, H, W, 3) -> Qwen-VL video patches, ordered as the image processor orders them;
        ``size`` (h, w) in pixels, else :meth:`video_frame_size`'s."""
        ip = self.image_processor
        p, m, tp = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        if len(frames) % tp:
            frames = np.concatenate([frames, np.repeat(frames[-1:], tp - len(frames) % tp, axis=0)])
        n, height, width = frames.shape[:3]
        h, w = size or self.video_frame_size(n, height, width)
        resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC)) for f in frames])
        x = (resized.astype(np.float32) / 255.0 - np.array(ip.image_mean, np.float32)) / np.array(ip.image_std, np.float32)
        x = x.transpose(0, 3, 1, 2)  # (N, C, H, W)
        gt, gh, gw = n // tp, h // p, w // p
        x = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, C, tp, p, p)
        return torch.from_numpy(np.ascontiguousarray(x).reshape(gt * gh * gw, 3 * tp * p * p)), (gt, gh, gw)

    def token_types(self, ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image, 2 video per token of ``ids`` (transformers' ``mm_token_type_ids``)."""
        types = torch.zeros_like(ids, dtype=torch.int)
        types[ids == self.config.image_token_id] = 1
        types[ids == self.config.video_token_id] = 2
        return types

    def positions(self, ids, b, pixels, next_position):
        """M-RoPE ids by the rule the model was trained with (:mod:`.mrope_positions`: the authors'
        unless its config names another), not by the installed transformers' ``get_rope_index``,
        whose rule for the text after a video changed between releases."""
        types = self.token_types(ids)
        if not (types != 0).any():
            return super().positions(ids, b, pixels, next_position)
        def given(key):  # the processor's rows for ``key``, every message's together
            return torch.cat(pixels[key]).float().tolist() if key in pixels else []

        return model_positions(self.config, types[0].tolist(), given("image_grid_thw"), given("video_grid_thw"),
                               given("second_per_grid_ts"), next_position)


class Qwen3VLAdapter(QwenVLAdapter):
    """Qwen3-VL: Qwen2-VL's markers and image path; a video is one group per temporal patch, each
    ``<t seconds>`` then its tokens between vision markers, so time is read from text, and the
    temporal rotary id just follows the text (interleaved M-RoPE; ``get_rope_index`` splits the grid
    per frame). DeepStack features ride with ``pixel_values`` inside the model's own forward."""

    video_chunking = None  # each group's timestamp text sits between the frames

    def positions(self, ids, b, pixels, next_position):
        """The model's own ``get_rope_index``: it places each frame as a block of one temporal step,
        so the text after it starts at its largest position + 1 under every transformers 5 release."""
        types = self.token_types(ids)
        if not (types != 0).any():
            return ChatAdapter.positions(self, ids, b, pixels, next_position)
        kwargs = {k: torch.cat(pixels[k]) for k in ("image_grid_thw", "video_grid_thw") if k in pixels}
        pos, _ = self.model.model.get_rope_index(ids, types, **kwargs)
        pos = pos[:, 0] + next_position
        return pos, int(pos.max()) + 1

    def add_video(self, b, video, pixels) -> None:
        patches, grid = self.patchify_video(video.frames)
        merge, tp = self.image_processor.merge_size, self.image_processor.temporal_patch_size
        t, h, w = grid
        per_frame = (h // merge) * (w // merge)
        times = list(video.timestamps) + [video.timestamps[-1]] * (t * tp - len(video.timestamps))
        frames = []
        for i in range(t):  # the processor's timestamp: the mean time of the frames a patch pairs
            moment = (times[i * tp] + times[i * tp + tp - 1]) / 2
            b.add_text(self.tokens(f"<{moment:.1f} seconds>") + [self.config.vision_start_token_id])
            frames.append((b.here, b.here + per_frame))
            b.ids.extend([self.config.video_token_id] * per_frame)
            b.add_text([self.config.vision_end_token_id])
        b.visuals.append(VisualSpan("video", (frames[0][0], frames[-1][1]), frames, (t, h // merge, w // merge)))
        pixels.setdefault("pixel_values_videos", []).append(patches)
        pixels.setdefault("video_grid_thw", []).append(torch.tensor([grid]))


class LlavaAdapter(ChatAdapter):
    """LLaVA-1.5 (and LLaVA-NeXT / OneVision through their processors): 1-D RoPE, videos as frames."""

    system_open, system_close = "", " "
    user_open, user_close = "USER: ", " "
    assistant_open, assistant_close = "ASSISTANT:", ""

    def add_image(self, b, image, pixels) -> None:
        token = self.tokenizer.convert_ids_to_tokens(self.config.image_token_id)
        out = self.processor(text=token, images=[image], return_tensors="pt", add_special_tokens=False)
        ids = out["input_ids"][0].tolist()
        image_ids = [i for i in ids if i == self.config.image_token_id]
        side = int(round(len(image_ids) ** 0.5))
        b.add_visual("image", image_ids, grid=(1, side, side) if side * side == len(image_ids) else None)
        for key, value in out.items():
            if key not in ("input_ids", "attention_mask", "mm_token_type_ids"):
                pixels.setdefault(key, []).append(value)


class MistralLlavaAdapter(LlavaAdapter):
    """llava-v1.6-mistral: [INST] markers."""

    system_open, system_close = "", "\n"
    user_open, user_close = "[INST] ", " "
    assistant_open, assistant_close = "[/INST]", ""


class ChatMLLlavaAdapter(LlavaAdapter):
    """LLaVA-OneVision (Qwen2 decoder): ChatML markers, 1-D RoPE."""

    system_open, system_close = "<|im_start|>system\n", "<|im_end|>\n"
    user_open, user_close = "<|im_start|>user\n", "<|im_end|>\n"
    assistant_open, assistant_close = "<|im_start|>assistant\n", "\n"


ADAPTERS = {
    "qwen2_vl": QwenVLAdapter,
    "qwen2_5_vl": QwenVLAdapter,
    "qwen3_vl": Qwen3VLAdapter,
    "qwen3_vl_moe": Qwen3VLAdapter,
    "llava": LlavaAdapter,
    "llava_next": MistralLlavaAdapter,
    "llava_onevision": ChatMLLlavaAdapter,
}
