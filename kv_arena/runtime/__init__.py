"""The runtime: models by name (:mod:`.models`, configs in ``configs/``), inputs and prompt layout
(:mod:`.inputs`), the cache (:mod:`.cache`), the attention seam the KV backends plug
into (:mod:`.attention`), one forward pass through it (:mod:`.forward`) and generation with
meters (:mod:`.generate`); :mod:`.capacity`: what fits beside the weights on a card (arithmetic)."""
