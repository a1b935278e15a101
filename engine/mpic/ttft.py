"""Time to first token of one prompt under MPIC's modes, in a session's current store state: the
app's "prefix caching vs MPIC" panel and ``python -m engine.bench --mode mpic`` both measure with it."""

from __future__ import annotations

import backends

from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from .kv_store import KVStore
from .linking import Linker


def time_prompt(loaded, store: KVStore, session: str, message: Message, mode: str, **params) -> dict:
    """One answer token under ``mode``: its TTFT, the token, and what the linker did per visual."""
    conv = Conversation(loaded, backends.make_backend("mpic", mode=mode, **params), linker=Linker(store, session))
    update = conv.ask(message, max_new_tokens=1)
    return {"ttft_s": update.metrics.ttft_s, "first_token": update.token_ids[0], "status": list(conv.linker.status),
            "prompt_tokens": update.metrics.prompt_tokens}


def measure_ttft(loaded, store: KVStore, session: str, message: Message, modes=("prefix", "mpic"),
                 **params) -> dict[str, dict]:
    """TTFT of this prompt under each mode, in the session's current store state (the app's
    "prefix caching vs MPIC" panel): mode -> :func:`time_prompt`'s figures."""
    return {mode: time_prompt(loaded, store, session, message, mode, **params) for mode in modes}
