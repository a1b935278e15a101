"""What the public endpoints say about each parameter, for Gradio's API page and its MCP tools.

Gradio describes an endpoint from its function: the docstring's first lines are the summary, each
``name: text`` line under ``Args:`` describes the parameter of that name in the signature (one line
each), and the function's name is the MCP tool's. The settings reach the events as keyword arguments
(``inputs_kwargs``) gathered in ``**controls``, so :func:`documented` lists them in the signature, as
keyword-only parameters, and gives each its line: the base controls' from :data:`BASE`, every
method's own parameter's from the registry (its help, range and default), so a new method's
parameters are described without touching this module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from kv_arena import service

from .settings import COMPRESS, RANGES, STREAMED_FRAMES, control_names, param_order, streaming_methods

BASE = {
    "model": "the model's name (`python -m kv_arena.bench --list`); tiny-arena-vl is the offline model trained on "
             "drawn scenes, tiny-* and random:* models have random weights.",
    "method": "the KV-cache method's registry name (`python -m kv_arena.bench --list`), e.g. snapkv, h2o, "
              "streamingllm; full keeps every key and value.",
    "budget": f"the fraction of the full cache's KV bytes the method may hold, {RANGES['budget'][0]:g} to 1.0 "
              "(1.0 keeps everything); a method with its own knob instead ignores it.",
    "max_new_tokens": f"the most tokens an answer may have, {RANGES['max_new_tokens'][0]} to "
                      f"{RANGES['max_new_tokens'][1]}.",
    "num_frames": f"frames sampled from each video, {RANGES['num_frames'][0]} to {RANGES['num_frames'][1]} "
                  f"(up to {STREAMED_FRAMES[1]:,} when stream_cap_mb is above 0); a video with fewer is read whole; "
                  "null: the model's default (tiny-arena-vl: {arena_frames}, every frame of its videos; the others: "
                  f"{service.DEFAULT_FRAMES}). A client that leaves it out sends the page's default, the first model's.",
    "compress": f"when the cache is compressed: {COMPRESS[0][1]} (the method sees the question) or "
                f"{COMPRESS[1][1]} (the media are prefilled and compressed first, then the question is asked).",
    "stream_cap_mb": "a KV cap in MB for /chat: the message's media stream in a few frames at a time and the "
                     "method keeps the cache under the cap (0 = off; the methods that can: {streaming}); "
                     "/compare ignores it.",
}


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"  # 2,147,483,647, not 2.14748e+09


def _range(spec: dict) -> str:
    if spec.get("choices"):
        return "one of " + ", ".join(spec["choices"])
    if spec.get("minimum") is not None and spec.get("maximum") is not None:
        return f"{_number(spec['minimum'])} to {_number(spec['maximum'])}"
    return spec["kind"]


def control_lines() -> dict[str, str]:
    """Every control's API name -> its one-line description (a method's own parameter is
    ``<method>_<parameter>``, used only when that method runs)."""
    lines = {name: text.format(streaming=streaming_methods(), arena_frames=service.default_frames(service.ARENA))
             for name, text in BASE.items()}
    titles = {spec["name"]: spec["title"] for spec in service.method_specs()}
    for method, spec in param_order():
        help_text = spec["help"].rstrip(".")
        lines[f"{method}_{spec['name']}"] = (f"{titles[method]}'s {spec['name']} (used when it runs): {help_text}; "
                                             f"{_range(spec)}, default {spec['default']}.")
    return {name: lines[name] for name in control_names()}


def documented(fn: Callable, tool: str, returns: str, lines: dict[str, str] | None = None) -> Callable:
    """``fn`` (an event taking the controls as ``**controls``) named ``tool``, its signature listing
    each control as a keyword-only parameter and its docstring a line for each (``lines``, or every
    control's) after its own ``Args:``, then ``returns``."""
    lines = control_lines() if lines is None else lines
    own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in lines]
    fn.__signature__ = inspect.Signature(own + extra)
    fn.__name__ = fn.__qualname__ = tool
    fn.__doc__ = "\n".join([inspect.getdoc(fn) or "", *(f"    {name}: {text}" for name, text in lines.items()),
                            "Returns:", f"    {returns}"])
    return fn
