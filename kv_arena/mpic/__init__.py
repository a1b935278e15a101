"""MPIC's runtime side: the media KV store (:mod:`.kv_store`) and linking stored media KV into a
prompt (:mod:`.linking`); the method itself is ``backends/mpic.py``, which implements the protocol
``backends/media_reuse.py`` declares."""
