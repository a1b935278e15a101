"""tiny-arena-vl: a Qwen2.5-VL-architecture model small enough to ship, trained by
``training/train_tiny_vlm.py`` on the scenes of :mod:`engine.scenes` (weights in assets/)."""

from __future__ import annotations

from pathlib import Path

import torch

from .scenes import SIZE
from .tiny import byte_tokenizer, tiny_config

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-arena-vl"
WEIGHTS = "model.safetensors"
# The app's clickable examples for this model: (question, media files in assets/), each answered right.
EXAMPLES: list[tuple[str, list[str]]] = [("How many cells are green?", ["board_1.png"]),
                                         ("Colour of cell C?", ["board_2.png"])]


def arena_config():
    """The tiny Qwen2.5-VL config with a vision tower that sees one grid cell at a time: its window is
    one cell (28 px = 2x2 patches = one merged token) and no block attends across windows."""
    config = tiny_config("qwen2_5_vl")
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size = 64, 128
    vision.window_size = 28
    vision.fullatt_block_indexes = []
    return config


def arena_image_processor():
    """Every image is resized to the board's size (84 px -> 9 tokens), as in training. Nearest-neighbour,
    so that a board drawn larger (the app's examples) comes back pixel for pixel, exactly as trained."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=SIZE * SIZE, max_pixels=SIZE * SIZE, resample=Image.NEAREST)


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
        from .errors import UserError

        raise UserError(f"{path} is missing; train it with: python training/train_tiny_vlm.py")
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ValueError(f"{path} does not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")


def tokenizer():
    return byte_tokenizer("qwen")
