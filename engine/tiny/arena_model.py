"""tiny-arena-vl: a Qwen2.5-VL-architecture model small enough to ship, trained by the repo
(training/train_arena.py) on the mostly-background scenes, image sets and videos of
engine/tiny/arena_scenes.py, with a word-level tokenizer made in code. Its bundle is assets/tiny-arena-vl.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import arena_scenes
from .builtin import tiny_config

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "tiny-arena-vl"
WEIGHTS = "model.safetensors"
VERSION_KEY = "arena_version"  # written into config.json: 2 (the first generation, 3x3 boards, is gone)
SYSTEM_WORDS = ("system", "user", "assistant", "you", "are", "a", "helpful", ".")  # chat markers, DEFAULT_SYSTEM


def tokenizer():
    from .word_tokenizer import word_tokenizer

    return word_tokenizer(SYSTEM_WORDS + arena_scenes.WORDS)


def arena_config():
    """The tiny Qwen2.5-VL config with a vision tower that sees one grid cell at a time: its window is
    one cell (28 px = 2x2 patches = one merged token) and no block attends across windows; the
    word-level vocabulary, special tokens first."""
    config = tiny_config("qwen2_5_vl")
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size = 64, 128
    vision.window_size = 28
    vision.fullatt_block_indexes = []
    tok = tokenizer()
    text = config.text_config
    text.vocab_size = len(tok)
    text.bos_token_id, text.eos_token_id = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    for name, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        setattr(config, name, tok.convert_tokens_to_ids(token))
    setattr(config, VERSION_KEY, 2)
    return config


def arena_image_processor():
    """Images keep their size between 224 px (8x8 tokens) and 448 px (16x16), so one 280 px scene is
    10x10 tokens, and an 8-frame 224 px video keeps its size (a video shares the image budget).
    Nearest-neighbour, so that scenes drawn larger come back pixel for pixel, exactly as trained."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    small = arena_scenes.SMALL * arena_scenes.CELL
    return Qwen2VLImageProcessorPil(min_pixels=small * small, max_pixels=4 * small * small, resample=Image.NEAREST)


def build_arena_model(seed: int = 0):
    """Random-initialised model (training starts here)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(arena_config())


def arena_weights_present(directory: Path = ASSET_DIR) -> bool:
    return (directory / WEIGHTS).is_file()


def load_arena_weights(model, directory: Path = ASSET_DIR) -> None:
    from safetensors.torch import load_file

    path = directory / WEIGHTS
    if not path.exists():
        from ..errors import UserError

        raise UserError(f"{path} is missing; train it with: python training/train_arena.py")
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ValueError(f"{path} does not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
