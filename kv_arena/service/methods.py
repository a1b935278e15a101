"""The KV-cache methods as the UI describes them: plain dictionaries from the registry, so the
panels, the Compare tab and the About page never import a backend (or torch) themselves."""

from __future__ import annotations

from functools import lru_cache

from kv_arena import backends
from kv_arena.backends.descriptions import describe
from kv_arena.backends.descriptions import shown_title as shown_title  # the pickers' and About's title
from kv_arena.backends.media_reuse import ReusesMedia
from kv_arena.backends.params import BUDGET
from kv_arena.backends.stack import SIGN
from kv_arena.backends.stack import params_owner as params_owner  # whose parameters a stack takes

from ..errors import UserError
from ..runtime.models import model_config
from ..runtime.vision_tokens import config_refusal


# A method holding at least this share of the full cache's KV after the prompt compressed nothing:
# Compare says so, the blind test draws another method, Chat explains no "right although compressed"
HOLDS_ALL = 0.995


def reuses_media(name: str) -> bool:
    """Whether the method reuses media KV stored beforehand (MPIC): its turns store the message's
    media first, its conversation gets a linker, its chat has a media library and a TTFT panel.
    False for a name that is no method."""
    try:
        return issubclass(backends.backend_class(name), ReusesMedia)
    except ValueError:
        return False


def is_reference(name: str) -> bool:
    """Whether ``name`` is the method every figure is measured against (the full cache)."""
    return backends.is_reference(name)


def budget_spec() -> dict:
    """The budget every method with one takes, as its schema says (range, step, help): the slider
    reads it from here, never a copy."""
    return BUDGET.to_dict()


def reference_spec() -> dict:
    """The reference method's description (:func:`method_spec`)."""
    return method_spec(backends.reference_name())


def method_specs() -> list[dict]:
    """Every registered method as :func:`method_spec` describes it, the full cache first."""
    return [method_spec(name) for name in backends.available()]


def method_spec(name: str) -> dict:
    """One method's description (:func:`~backends.descriptions.describe`: title, paper, summary,
    parameters...) and ``reuses_media`` (:func:`reuses_media`); ValueError if unknown."""
    return describe(backends.backend_class(name)) | {"reuses_media": reuses_media(name)}


def title_of(name: str) -> str:
    """A method's title where a method is picked or named for a verdict (the pickers, Compare's
    columns, the blind test, the leaderboard): :func:`shown_title`, so a plugin's says its package; a
    name no longer registered (an older version's votes) as it is. Progress and status lines keep the
    plain title."""
    try:
        return shown_title(method_spec(name))
    except ValueError:
        return name


def checked_params(params: dict[str, dict]) -> dict[str, dict]:
    """Every method's parameter values of the type and range its paper's schema says (a NaN, an
    infinity, a list... is a UserError), whichever method is picked: a comparison runs the others."""
    checked: dict[str, dict] = {}
    for method, values in params.items():
        try:
            specs = {p.name: p for p in backends.backend_class(method).param_specs()}
            checked[method] = {name: specs[name].coerce(value) if name in specs else value
                               for name, value in values.items()}
        except ValueError as exc:
            raise UserError(f"{method}: {exc}") from None
    return checked


@lru_cache(maxsize=64)
def refused_methods(model: str) -> dict[str, str]:
    """The methods that cannot run on ``model`` with their own defaults, each with why (one line):
    VisionZip needs a CLIP tower with a CLS token (LLaVA-1.5). Read from the model's config, so no
    weights load and nothing downloads; an unknown model is a UserError."""
    config = model_config(model)
    out = {}
    for name in backends.available():
        reason = config_refusal(config, backends.make_backend(name, budget=BUDGET.default))
        if reason is not None:
            out[name] = reason
    return out


def methods_on(model: str) -> list[str]:
    """The methods that run on ``model`` (:func:`refused_methods` left out), the full cache first."""
    refused = refused_methods(model)
    return [name for name in backends.available() if name not in refused]


STACKED = "snapkv"  # the method the app offers on each quantised store (Chat, Compare, the blind test)


def stacks_of(selector: str = STACKED) -> list[str]:
    """``selector`` on each quantised store (``snapkv+fp8``, ``snapkv+int4``): the stacks the app offers."""
    return [f"{selector}{SIGN}{store}" for store in backends.names_where(lambda cls: cls.quantised_store)]
