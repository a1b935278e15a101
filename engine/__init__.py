"""Everything below the UI, one package per job; each layer imports only the ones below it
(checked by ``lint-imports``, see pyproject.toml):

* :mod:`engine.service`: the app's facade (sessions, turns, the figures the panels draw).
* :mod:`engine.bench`: the benchmark CLIs (``python -m engine.bench``).
* :mod:`engine.mpic`: MPIC's media KV store and how stored media is linked into a prompt.
* :mod:`engine.runtime`: models, inputs and prompt layout, the cache, the attention seam, generation.
* :mod:`engine.tiny`: the offline tiny models: built-in random ones, and tiny-arena-vl (trained
  here) with its word tokenizer and scenes.
* :mod:`engine.media`: images and videos read from disk within limits (the scenes make videos too,
  so it sits below both the runtime and the tiny models).
* :mod:`engine.errors`: errors a user can fix.
"""
