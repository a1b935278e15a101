"""One turn's settings resolved once: :func:`plan_turn` turns the controls' :class:`Settings` into
a :class:`Plan` (the method built, the cap it streams under, the generation arguments) before any
model work. The chat turn, a comparison, streaming and MPIC read the plan; none of them builds the
method again or re-derives what the settings mean."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kv_arena import backends
from kv_arena.backends.base import KVBackend
from kv_arena.backends.media_reuse import ReusesMedia

from ..errors import UserError
from .inputs import Settings


@dataclass(frozen=True)
class Plan:
    """What one turn runs. ``backend`` is built once, here: it holds the conversation when the turn
    starts one (a turn that continues a chat keeps the chat's own)."""

    settings: Settings  # as sent (the cache's and the references' keys are made from it)
    backend: KVBackend
    cap_bytes: int | None  # the KV cap the media stream under; None: one prompt, or the full cache's own run

    @property
    def method(self) -> str:
        return self.backend.name

    @property
    def is_reference(self) -> bool:
        return self.backend.is_reference

    @property
    def reuses_media(self) -> bool:
        """MPIC-like: the turn stores the message's media first and the conversation gets a linker."""
        return isinstance(self.backend, ReusesMedia)

    @property
    def streamed(self) -> bool:
        return self.settings.streamed

    @property
    def generation(self) -> dict:
        """The arguments of ``Conversation.ask`` / ``stream`` besides the message."""
        return {"max_new_tokens": self.settings.max_new_tokens, "temperature": self.settings.temperature,
                "question_after": self.settings.question_after}


def plan_turn(settings: Settings, method: str | None = None, streamed: bool = True) -> Plan:
    """The plan for ``method`` (default: the picked one) under ``settings``; bad values, or a cap
    asked of a method that cannot hold one, raise a UserError. ``streamed=False``: one prompt
    whatever the cap (a comparison)."""
    name = method or settings.method
    try:
        backend = backends.make_backend(name, budget=settings.budget, **settings.method_params(name))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    streams = streamed and settings.streamed
    if streams and not (backend.is_reference or backend.streams_under_cap):
        can = ", ".join(backends.backend_class(n).title for n in backends.names_where(lambda c: c.streams_under_cap))
        raise UserError(f"{backend.title} cannot stream a video under a memory cap; pick a method that can "
                        f"({can}), the full cache, or set the cap to 0.")
    cap = settings.cap_bytes if streams and not backend.is_reference else None
    return Plan(replace(settings, method=name), backend, cap)
