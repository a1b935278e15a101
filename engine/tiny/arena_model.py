"""tiny-arena-vl: a Qwen2.5-VL-architecture model small enough to ship, trained by the repo, with a
word-level tokenizer made in code. Its bundle is assets/tiny-arena-vl; ``arena_version`` in its
config.json says which generation it is:
  2  tiles: the scenes of engine/tiny/arena_scenes.py (training/train_arena.py)
  3  drawings: the scenes of engine/tiny/drawn_scenes.py (training/train_arena_v3.py)
Every function here takes the generation; the app reads it from the bundle (``bundled_version``).
"""

from __future__ import annotations

from pathlib import Path

import json
import os

import torch

from . import arena_scenes, drawn_scenes
from .builtin import tiny_config

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "tiny-arena-vl"
WEIGHTS = "model.safetensors"
VERSION_KEY = "arena_version"  # written into config.json (the first generation, 3x3 boards, is gone)
SYSTEM_WORDS = ("system", "user", "assistant", "you", "are", "a", "helpful", ".")  # chat markers, DEFAULT_SYSTEM


def scenes(version: int = 2):
    """The scene module a generation was trained on."""
    return {2: arena_scenes, 3: drawn_scenes}[version]


def arena_dir() -> Path:
    """Where the app loads tiny-arena-vl from: ``KV_ARENA_TINY_DIR`` (a training run's folder) or the bundle."""
    return Path(os.environ.get("KV_ARENA_TINY_DIR") or ASSET_DIR)


def bundled_version(directory: Path | None = None) -> int:
    """The generation of the weights in ``directory`` (default: :func:`arena_dir`; 2 when its
    config.json does not say)."""
    path = (directory or arena_dir()) / "config.json"
    return int(json.loads(path.read_text()).get(VERSION_KEY, 2)) if path.is_file() else 2


def tokenizer(version: int = 2):
    from .word_tokenizer import word_tokenizer

    return word_tokenizer(SYSTEM_WORDS + scenes(version).WORDS)


def arena_config(version: int = 2):
    """The tiny Qwen2.5-VL config and the word-level vocabulary, special tokens first.
    v2's vision tower sees one grid cell at a time: its window is one cell (28 px = 2x2 patches =
    one merged token) and no block attends across windows. v3's reads drawings: four blocks of
    width 128 (1.1 M parameters), windows of 112 px (4x4 tokens, wider than any object) and a last
    block of full attention, so an object cut by the token grid is seen whole (training stage 1,
    training/train_arena_v3_eyes.py, teaches it shapes from per-token targets)."""
    config = tiny_config("qwen2_5_vl")
    vision = config.vision_config
    if version == 3:
        vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads = 4, 128, 256, 2
        vision.window_size, vision.fullatt_block_indexes = 112, [3]
    else:
        vision.hidden_size, vision.intermediate_size = 64, 128
        vision.window_size, vision.fullatt_block_indexes = 28, []
    tok = tokenizer(version)
    text = config.text_config
    text.vocab_size = len(tok)
    text.bos_token_id, text.eos_token_id = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    for name, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        setattr(config, name, tok.convert_tokens_to_ids(token))
    setattr(config, VERSION_KEY, version)
    return config


def arena_image_processor(version: int = 2):
    """v2: images keep their size between 224 px (8x8 tokens) and 448 px (16x16), so one 280 px scene
    is 10x10 tokens; nearest-neighbour, so that scenes drawn larger come back pixel for pixel.
    v3: between 8x8 and 48x48 tokens (224 to 1344 px a side), bicubic, as a real model's processor;
    a video shares that budget (32 frames of 336 px keep their size: 16 x 144 tokens)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if version == 3:
        cell = drawn_scenes.CELL**2
        return Qwen2VLImageProcessorPil(min_pixels=drawn_scenes.MIN_CELLS * cell, max_pixels=drawn_scenes.MAX_CELLS * cell)
    small = arena_scenes.SMALL * arena_scenes.CELL
    return Qwen2VLImageProcessorPil(min_pixels=small * small, max_pixels=4 * small * small, resample=Image.NEAREST)


def build_arena_model(seed: int = 0, version: int = 2):
    """Random-initialised model (training starts here)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(arena_config(version))


def arena_weights_present(directory: Path | None = None) -> bool:
    return ((directory or arena_dir()) / WEIGHTS).is_file()


def load_arena_weights(model, directory: Path | None = None) -> None:
    from safetensors.torch import load_file

    path = (directory or arena_dir()) / WEIGHTS
    if not path.exists():
        from ..errors import UserError

        raise UserError(f"{path} is missing; train it with: python training/train_arena.py")
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ValueError(f"{path} does not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
