"""tiny-arena-vl: a Qwen2.5-VL-architecture model small enough to ship, trained by the repo, with a
word-level tokenizer made in code. Its bundle is assets/tiny-arena-vl; ``arena_version`` in its
config.json says which generation it is (:mod:`.generations` maps it to the generation's scenes and
model). Here: what every generation shares (the folder, the tokenizer, building and loading) and
generation 2's config (tiles: the scenes of arena_scenes.py, trained by training/train_arena.py);
generation 3 changes it in arena_v3_model.py.
"""

from __future__ import annotations

from pathlib import Path

import json
import os

import torch

from ..paths import ASSETS
from . import arena_scenes
from .builtin import tiny_config

ASSET_DIR = ASSETS / "tiny-arena-vl"
WEIGHTS = "model.safetensors"
VERSION_KEY = "arena_version"  # written into config.json (the first generation, 3x3 boards, is gone)
V2 = 2  # generation 2's arena_version; a config.json that does not say is v2's
# the M-RoPE rule every generation so far was trained with (positions from transformers 5.3-5.24's
# get_rope_index: the text after a video at its start + the frame's larger side, not after its last
# time id), recorded in config.json and kept for it (kv_arena.runtime.mrope_positions: RULE_KEY, FRAME_EXTENT)
ROPE_RULE_KEY, TRAINED_ROPE_RULE = "rope_text_after_media", "frame_extent"
TRAINED_BY = {V2: "training.train_arena", 3: "training.train_arena_v3"}  # each generation's training module
SYSTEM_WORDS = ("system", "user", "assistant", "you", "are", "a", "helpful", ".")  # chat markers, DEFAULT_SYSTEM


def arena_dir() -> Path:
    """Where the app loads tiny-arena-vl from: ``KV_ARENA_TINY_DIR`` (a training run's folder) or the bundle."""
    return Path(os.environ.get("KV_ARENA_TINY_DIR") or ASSET_DIR)


def bundled_version(directory: Path | None = None) -> int:
    """The generation of the weights in ``directory`` (default: :func:`arena_dir`; 2 when its
    config.json does not say)."""
    path = (directory or arena_dir()) / "config.json"
    return int(json.loads(path.read_text()).get(VERSION_KEY, V2)) if path.is_file() else V2


def trained_rope_rule(directory: Path | None = None) -> str:
    """The M-RoPE rule the weights in ``directory`` were trained with, as their config.json records it
    (one that does not say: :data:`TRAINED_ROPE_RULE`, every generation's so far)."""
    path = (directory or arena_dir()) / "config.json"
    return json.loads(path.read_text()).get(ROPE_RULE_KEY, TRAINED_ROPE_RULE) if path.is_file() else TRAINED_ROPE_RULE


def tokenizer(words: tuple[str, ...] = arena_scenes.WORDS):
    """The word-level tokenizer of the chat markers, the system prompt and a generation's ``words``."""
    from .word_tokenizer import word_tokenizer

    return word_tokenizer(SYSTEM_WORDS + words)


def arena_config(words: tuple[str, ...] = arena_scenes.WORDS, version: int = V2):
    """The tiny Qwen2.5-VL config over the word-level vocabulary of ``words``, special tokens first.
    v2's vision tower sees one grid cell at a time: its window is one cell (28 px = 2x2 patches =
    one merged token) and no block attends across windows. Generation 3 changes the vision tower
    of this config (arena_v3_model.py)."""
    config = tiny_config("qwen2_5_vl")
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size = 64, 128
    vision.window_size, vision.fullatt_block_indexes = 28, []
    tok = tokenizer(words)
    text = config.text_config
    text.vocab_size = len(tok)
    text.bos_token_id, text.eos_token_id = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    for name, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        setattr(config, name, tok.convert_tokens_to_ids(token))
    setattr(config, VERSION_KEY, version)
    setattr(config, ROPE_RULE_KEY, TRAINED_ROPE_RULE)
    return config


def arena_image_processor():
    """Images keep their size between 224 px (8x8 tokens) and 448 px (16x16), so one 280 px scene
    is 10x10 tokens; nearest-neighbour, so that scenes drawn larger come back pixel for pixel."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    small = arena_scenes.SMALL * arena_scenes.CELL
    return Qwen2VLImageProcessorPil(min_pixels=small * small, max_pixels=4 * small * small, resample=Image.NEAREST)


def build_arena_model(seed: int = 0, config=None):
    """Random-initialised model of ``config`` (default: :func:`arena_config`'s): training starts here."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config if config is not None else arena_config())


def arena_weights_present(directory: Path | None = None) -> bool:
    return ((directory or arena_dir()) / WEIGHTS).is_file()


def training_command(directory: Path | None = None) -> str:
    """How to train the weights of the generation the folder's config.json names (``python -m`` its
    training module, named, not imported); every generation's for a number this engine does not know."""
    known = TRAINED_BY.get(bundled_version(directory))
    return " or ".join(f"python -m {module}" for module in ([known] if known else TRAINED_BY.values()))


def load_arena_weights(model, directory: Path | None = None) -> None:
    from safetensors.torch import load_file

    path = (directory or arena_dir()) / WEIGHTS
    if not path.exists():
        from ..errors import UserError

        raise UserError(f"{path} is missing; train it with: {training_command(path.parent)}")
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ValueError(f"{path} does not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
