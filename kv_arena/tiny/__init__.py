"""The offline tiny models, made in code: the built-in random ones (:mod:`.builtin`) and
tiny-arena-vl, trained here (:mod:`.arena_model`), with its word-level tokenizer
(:mod:`.word_tokenizer`), the procedural scenes it was trained on (:mod:`.arena_scenes`) and
their question and item (:mod:`.scene_items`)."""
