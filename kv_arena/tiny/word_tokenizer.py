"""A word-level tokenizer made in code for tiny-arena-vl v2: every word it knows is one token, so
every answer is one token and the prompt's text stays short (the system prompt is 6 tokens).

Lower-cased; whitespace is dropped and punctuation split off ("colour?" -> "colour", "?"); unknown
words become ``<unk>``. The chat markers are the Qwen special tokens, so the app's QwenVLAdapter
builds prompts with it unchanged.
"""

from __future__ import annotations

from functools import lru_cache

from .builtin import QWEN_SPECIALS

UNK = "<unk>"


@lru_cache(maxsize=4)
def word_tokenizer(words: tuple[str, ...]):
    """A transformers tokenizer over the Qwen special tokens, ``<unk>`` and ``words`` (in that order)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(list(QWEN_SPECIALS) + [UNK] + list(dict.fromkeys(words)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=UNK, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS)})
    return tok
