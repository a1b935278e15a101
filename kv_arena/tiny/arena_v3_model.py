"""tiny-arena-vl generation 3: v2's model (arena_model.py) with the vocabulary of the drawings
(drawn_scenes.py) and a vision tower that reads them. Its training is training/train_arena_v3.py;
the engine serves it when the weights' config.json says ``arena_version`` 3 (:mod:`.generations`).
"""

from __future__ import annotations

from . import arena_model
from . import drawn_scenes as scenes

VERSION = 3  # config.json's arena_version


def tokenizer():
    return arena_model.tokenizer(scenes.WORDS)


def arena_config():
    """v2's config over the drawings' words, with a tower for drawings: four blocks of width 128
    (1.1 M parameters), windows of 112 px (4x4 tokens, wider than any object) and a last block of
    full attention, so an object cut by the token grid is seen whole (training stage 1,
    train_arena_v3_eyes.py, teaches it shapes from per-token targets)."""
    config = arena_model.arena_config(scenes.WORDS, VERSION)
    vision = config.vision_config
    vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads = 4, 128, 256, 2
    vision.window_size, vision.fullatt_block_indexes = 112, [3]
    return config


def image_processor():
    """Between 8x8 and 48x48 tokens (224 to 1344 px a side), bicubic, as a real model's processor;
    a video shares that budget (32 frames of 336 px keep their size: 16 x 144 tokens)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cell = scenes.CELL**2
    return Qwen2VLImageProcessorPil(min_pixels=scenes.MIN_CELLS * cell, max_pixels=scenes.MAX_CELLS * cell)
