"""Offline building blocks: a byte-level tokenizer and small configs of the real architectures.

Nothing here downloads anything. The tiny models keep the real visual-token counts (a 448 px
image is 256 tokens for Qwen-VL, 576 for LLaVA-1.5), so budgets like 0.1 mean something.
"""

from __future__ import annotations

from functools import lru_cache

from transformers import Qwen2Tokenizer

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
LLAVA_SPECIALS = ["<s>", "</s>", "<image>", "<video>", "<pad>"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, so every byte is one token."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@lru_cache(maxsize=4)
def byte_tokenizer(family: str) -> Qwen2Tokenizer:
    """One token per byte, plus the family's special tokens (ids 256, 257, ...)."""
    specials = QWEN_SPECIALS if family.startswith("qwen") else LLAVA_SPECIALS
    vocab = {char: i for i, char in enumerate(_bytes_to_unicode().values())}
    for token in specials:
        vocab[token] = len(vocab)
    if family.startswith("qwen"):
        tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    else:
        tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def tiny_text_config(vocab_size: int, **overrides) -> dict:
    base = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6)
    return base | overrides


def tiny_config(family: str):
    """Config of a tiny random model of ``family``: qwen2_vl, qwen2_5_vl, qwen3_vl or llava."""
    from transformers import LlavaConfig, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    tok = byte_tokenizer(family)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (QWEN_SPECIALS if family.startswith("qwen") else LLAVA_SPECIALS)}
    if family in ("qwen2_vl", "qwen2_5_vl"):
        text = tiny_text_config(len(tok), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [4, 6, 6]},
                                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
        common = dict(text_config=text, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                      vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                      tie_word_embeddings=False)
        if family == "qwen2_vl":
            vision = dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, mlp_ratio=2)
            return Qwen2VLConfig(vision_config=vision, **common)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                      window_size=112, fullatt_block_indexes=[0], tokens_per_second=2)
        return Qwen2_5_VLConfig(vision_config=vision, **common)
    if family == "qwen3_vl":
        # Qwen3 decoder (explicit head_dim, q/k norms), interleaved M-RoPE ([24, 20, 20] of 64 scaled
        # to 16 frequencies), 16 px patches, and DeepStack: three vision layers' features are added to
        # the first three decoder layers' hidden states at the visual tokens, as in the hub models.
        text = tiny_text_config(len(tok), head_dim=32, rope_parameters={
            "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                      patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[0, 1, 2])
        return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                             video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                             vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    if family == "llava":
        text = tiny_text_config(len(tok), model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=336, patch_size=14, projection_dim=32)
        return LlavaConfig(text_config=text, vision_config=vision, image_token_id=ids["<image>"],
                           vision_feature_layer=-2, vision_feature_select_strategy="default",
                           projector_hidden_act="gelu", tie_word_embeddings=False)
    raise ValueError(f"no tiny config for family '{family}'")


def tiny_image_processor(family: str, max_pixels: int = 448 * 448):
    """PIL image processors (no torchvision): 448 px -> 256 tokens (Qwen2/2.5-VL), 196 (Qwen3-VL, 16 px
    patches), 336 px -> 576 (LLaVA)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if family in ("qwen2_vl", "qwen2_5_vl"):
        return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels)
    if family.startswith("qwen3_vl"):  # the hub's Qwen2VLImageProcessor settings: 16 px patches, mean/std 0.5
        return Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=max_pixels, patch_size=16,
                                        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
