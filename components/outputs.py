"""An event's outputs by name, sent to Gradio by component.

A tab's event logic returns (or yields) an :class:`Outputs`: a frozen dataclass whose fields are
named as the tab's components, each a value, an update, or :data:`KEEP` (left as it is). Tests
read those fields by name. :func:`by_component` wires the logic to Gradio, which takes a dict
keyed by component and leaves the outputs it does not name as they are (as ``gr.skip()`` does:
each one left out still costs Gradio a rebuild of that component, so the logic leaves out only
what must stay and sends plain values, ``None`` included, where it can).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()  # an output left as it is


@dataclass(frozen=True)
class Outputs:
    """Base of a tab's outputs; a subclass names them (its fields default to :data:`KEEP`)."""

    def changed(self) -> dict[str, Any]:
        """The outputs this yield sets, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not KEEP}


def keyed(tab, outputs: Outputs) -> dict:
    """``outputs`` keyed by ``tab``'s components of the same names (a list of components takes a
    list of values, one each)."""
    keyed = {}
    for name, value in outputs.changed().items():
        component = getattr(tab, name)
        if isinstance(component, list):
            keyed.update(zip(component, value))
        else:
            keyed[component] = value
    return keyed


def by_component(tab, fn: Callable) -> Callable:
    """``fn`` (returning or yielding :class:`Outputs`) as a Gradio event of ``tab``'s components.
    The signature stays ``fn``'s (``functools.wraps``): Gradio reads the API's parameters,
    ``gr.Request`` and ``gr.Progress`` from it."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(*args, **kwargs):
            for outputs in fn(*args, **kwargs):
                yield keyed(tab, outputs)
        return stream

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return keyed(tab, fn(*args, **kwargs))
    return call


def components_of(tab, outputs: type[Outputs]) -> list:
    """Every component ``outputs`` can set, for the event's ``outputs=`` (in field order)."""
    found = []
    for f in fields(outputs):
        component = getattr(tab, f.name)
        found += component if isinstance(component, list) else [component]
    return found
