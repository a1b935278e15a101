"""The parameter schema of a KV-cache method: what the UI renders as a slider, checkbox or dropdown
and what the command line takes, with each default from the method's paper.

A method declares its parameters as dataclass fields made with :func:`param`; the
:class:`~backends.base.KVBackend` base class turns them into :class:`Param` specs and coerces the
values it is built with. ``budget``, which every method with a budget takes, is :data:`BUDGET`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


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
        """Convert ``value`` (possibly a string from the command line) to the parameter's type and
        check its range; a value of another shape (a list, NaN, an infinity, 2.5 for an int) is refused."""
        kind = self.kind
        if kind == "bool":
            value = _as_bool(self.name, value)
        elif kind in ("int", "float"):
            value = _as_number(self.name, kind, value)
        elif not isinstance(value, str):
            raise ValueError(f"parameter '{self.name}' expects text, got {_shown(value)}")
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


def _shown(value: Any) -> str:
    """A value as a one-line message shows it (short: a client may send anything)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if word in TRUE or word in FALSE:
        return word in TRUE
    raise ValueError(f"parameter '{name}' expects true or false, got {_shown(value)}")


def _as_number(name: str, kind: str, value: Any) -> int | float:
    """A finite number of ``kind`` ("int" or "float") from a number or its text; NaN and the
    infinities are refused here (every range check is false for NaN, so it would pass them)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"parameter '{name}' expects a {kind}, got {_shown(value)}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"parameter '{name}' expects a {kind}, got {_shown(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"parameter '{name}' expects a finite {kind}, got {_shown(value)}")
    if kind == "float":
        return number
    if not number.is_integer():
        raise ValueError(f"parameter '{name}' expects a whole number, got {_shown(value)}")
    return int(number)
