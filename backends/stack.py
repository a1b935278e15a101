"""Stacks: a method that chooses tokens on a quantised store, named ``selector+store`` (``snapkv+fp8``:
SnapKV keeps 0.4 of the tokens, FP8 stores them at about half the bytes: about 0.2 of the full
cache's bytes). Taken wherever a method's name is (the registry resolves the name, see
:func:`backends.backend_class`), never listed among the methods.

* The first part ``chooses_tokens`` (it only drops entries through ``KVLayer.keep``, or narrows the
  prefill, and never reads a layer's stored keys and values); the second is a ``quantised_store``
  (FP8, INT4), whose layers code each entry on its own and drop entries as a dense layer does.
* The stack is the selector with the store's layers: the budget and the parameters are the
  selector's (the store runs with its defaults), the report is the selector's, and the bytes are
  what the stack's layers hold (codes and scales of the entries kept).
* Refused in one line: a part that is no method, more or fewer than two parts, a store first, two
  selectors or two stores, a first part that does more than choose tokens (KIVI, H2O's own layers).
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import KVBackend

SIGN = "+"

_STACKS: dict[str, type[KVBackend]] = {}


def is_stack(name: str) -> bool:
    return SIGN in name


def params_owner(name: str) -> str:
    """The method whose parameters ``name`` takes: a stack's selector (its store runs with its
    defaults), else ``name`` itself."""
    return name.split(SIGN)[0].strip() if is_stack(name) else name


def stacked(name: str, registry: Mapping[str, type[KVBackend]]) -> type[KVBackend]:
    """The class of the stack ``name`` (the same class each time); ValueError, one line, if it is no stack."""
    if name not in _STACKS:
        selector, store = parts(name, registry)
        _STACKS[name] = compose(selector, store)
    return _STACKS[name]


def parts(name: str, registry: Mapping[str, type[KVBackend]]) -> tuple[type[KVBackend], type[KVBackend]]:
    """The selector and the store that ``name`` stacks, checked."""
    names = [p.strip() for p in name.split(SIGN)]
    selectors = ", ".join(n for n, c in registry.items() if selects(c))
    stores = ", ".join(n for n, c in registry.items() if c.quantised_store)
    if len(names) != 2 or not all(names):
        raise ValueError(f"'{name}': a stack is a method that chooses tokens, then a quantised store "
                         f"(e.g. snapkv+fp8); stores: {stores}")
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"'{name}': unknown method {', '.join(repr(n) for n in unknown)}; a stack is one of "
                         f"{selectors}, then one of {stores}")
    first, second = (registry[n] for n in names)
    if first.quantised_store and second.quantised_store:
        raise ValueError(f"'{name}': two stores; a stack is a method that chooses tokens, then one store")
    if first.quantised_store:
        raise ValueError(f"'{name}': the store comes second (a method that chooses tokens first, e.g. "
                         f"snapkv+{first.name})")
    if not second.quantised_store:
        raise ValueError(f"'{name}': {second.name} is no quantised store; stack on one of: {stores}")
    if not selects(first):
        raise ValueError(f"'{name}': {first.name} does more than choose tokens, so it cannot choose what a "
                         f"store holds; stack one of: {selectors}")
    return first, second


def selects(method: type[KVBackend]) -> bool:
    """Whether ``method`` can be a stack's first part: it only chooses tokens, in dense layers of the base kind."""
    return method.chooses_tokens and method.new_layer is KVBackend.new_layer


def compose(selector: type[KVBackend], store: type[KVBackend]) -> type[KVBackend]:
    """The selector's class with the store's layers."""

    def __post_init__(self) -> None:
        selector.__post_init__(self)
        self.store = store()

    def new_layer(self, layer_idx: int):
        return self.store.new_layer(layer_idx)

    return type(f"{selector.__name__}On{store.__name__}", (selector,), {
        "__module__": __name__, "__post_init__": __post_init__, "new_layer": new_layer,
        "name": f"{selector.name}{SIGN}{store.name}", "title": f"{selector.title} + {store.title}",
        "does": f"{selector.does}, {store.does}", "paper": selector.paper,
        "summary": (f"{selector.title} chooses the tokens (its budget: the share of the tokens kept); "
                    f"{store.title} stores what it keeps. {selector.summary}"),
        "chooses_tokens": False, "quantised_store": False})


__all__ = ["SIGN", "compose", "is_stack", "params_owner", "parts", "selects", "stacked"]
