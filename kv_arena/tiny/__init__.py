"""The offline tiny models, made in code: the built-in random ones (:mod:`.builtin`) and
tiny-arena-vl, trained here (:mod:`.arena_model`), with its word-level tokenizer
(:mod:`.word_tokenizer`), the procedural scenes each generation is trained on (v2's tiles,
:mod:`.arena_scenes`; v3's drawings, :mod:`.drawn_scenes` with its model, :mod:`.arena_v3_model`),
their question and item (:mod:`.scene_items`), and the seam that picks the generation the weights
are (:mod:`.generations`)."""
