"""The benchmark CLIs, all behind ``python -m kv_arena.bench`` (:mod:`.cli`):

* :mod:`.methods` (the default): every chosen method against the full cache on one input.
* :mod:`.prefill` (``--mode prefill``): the seam's prefill cost at real sizes, random weights.
* :mod:`.decode` (``--mode decode``): decode step time against the KV held.
* :mod:`.mpic` (``--mode mpic``): TTFT of media reuse against the number of images.
* :mod:`.accuracy` (``--mode accuracy``): answers right against the realised KV fraction (the scenes,
  or a public data set: :mod:`.datasets_items`, :mod:`.metrics`).
* :mod:`.capacity` (``--mode capacity``): what each method's cache fits beside the weights on a card
  (visual tokens, frames, pictures, conversations), from bytes per token measured on a short run.
* :mod:`.gpu_check` (``--mode gpu-check``): what a lent GPU runs, in at most 10 minutes (docs/gpu.md).
"""
