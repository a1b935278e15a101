"""The parameter schema of a KV-cache method: what the UI renders as a slider, checkbox or dropdown
and what the command line takes, with each default from the method's paper.

A method declares its parameters as dataclass fields made with :func:`param`; the
:class:`~backends.base.KVBackend` base class turns them into :class:`Param` specs and coerces the
values it is built with. ``budget``, which every method with a budget takes, is :data:`BUDGET`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Param:
    """One tunable of a method, with a default from its paper and the range the UI offers."""

    name: str
    default: float | int | bool | str
    help: str
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple[str, ...] | None = None

    @property
    def kind(self) -> str:
        if self.choices is not None:
            return "choice"
        return type(self.default).__name__  # "float", "int", "bool" or "str"

    def coerce(self, value: Any) -> Any:
        """Convert ``value`` (possibly a string from the command line) and check its range."""
        kind = self.kind
        try:
            if kind == "bool":
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
            elif kind == "int":
                value = int(float(value))
            elif kind == "float":
                value = float(value)
            else:
                value = str(value)
        except (TypeError, ValueError):
            raise ValueError(f"parameter '{self.name}' expects a {kind}, got {value!r}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"parameter '{self.name}' must be one of {', '.join(self.choices)}; got {value!r}")
        if kind in ("int", "float"):
            if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
                raise ValueError(f"parameter '{self.name}' must lie in [{self.minimum}, {self.maximum}]; got {value}")
        return value

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None} | {"kind": self.kind}


def param(default: float | int | bool | str, help: str, minimum: float | None = None, maximum: float | None = None,
          step: float | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A method's parameter as a dataclass field: ``window: int = param(32, "help", 1, 512, 1)``.

    The default is the field's default; help, range, step and choices ride in its metadata, from
    which :meth:`backends.base.KVBackend.param_specs` builds the :class:`Param` the UI and the CLI describe."""
    spec = {"help": help, "minimum": minimum, "maximum": maximum, "step": step, "choices": choices}
    return field(default=default, metadata={"param": spec})


BUDGET = Param("budget", 1.0, "Fraction of the full cache's KV bytes the method may hold (1.0 keeps everything).", 0.01, 1.0, 0.01)
