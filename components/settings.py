"""The settings: the model and what every tab shares (generation length, video frames, when and how
a video is compressed) in the sidebar; the Method, its Budget and its own parameters beside the
Chat tab's conversation (:func:`render_method_controls`).

Methods and their parameter controls come from the backend registry, described by the facade
(``service.method_specs``), so a method added to ``backends/`` appears here without touching the
UI. Every event receives the controls' values positionally (``SettingsPanel.inputs``);
:func:`settings_from` turns them back into :class:`kv_arena.service.Settings`, and
:func:`control_values` builds them for tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from kv_arena import service
from kv_arena.errors import UserError

from . import checked_controls
from .outputs import KEEP, Outputs, by_component, components_of

log = logging.getLogger(__name__)
BASE_CONTROLS = ("model", "method", "budget", "max_new_tokens", "num_frames", "compress", "stream_cap_mb")
# a compressing method by default: the first answer already shows what compression saves and costs
DEFAULT_METHOD = "snapkv"
# (the video frames' default is the model's: service.default_frames)
DEFAULTS = {"budget": 0.3, "max_new_tokens": 48, "compress": "with_question", "stream_cap_mb": 0}
# When the method compresses a message with media: (label, API value)
COMPRESS = [("With the question (the method sees what you ask)", "with_question"),
            ("Before the question (the media are cached first, as a stored picture is)", "before_question")]
# the controls' ranges; a video streamed under a cap may have more frames (STREAMED_FRAMES)
BUDGET_SPEC = service.budget_spec()  # the methods' budget schema: the slider's range, step and help
RANGES = {"budget": (BUDGET_SPEC["minimum"], BUDGET_SPEC["maximum"]), "max_new_tokens": (1, 512),
          "num_frames": (1, service.MAX_FRAMES), "stream_cap_mb": (0, 65536)}
STREAMED_FRAMES = (1, service.MAX_STREAMED_FRAMES)
LABELS = {"budget": "The budget", "max_new_tokens": "Max new tokens", "num_frames": "Video frames",
          "stream_cap_mb": "The memory cap (MB)"}
FRAMES_INFO = ("Frames sampled uniformly from an attached video (a shorter one: all of them). Picking a model "
               "sets its default (tiny-arena-vl: every frame of its videos) unless you changed it.")


def checked(name: str, value, limits: tuple[float, float] | None = None) -> float:
    """A base control's value, or a UserError that says the allowed range (never a silent clamp)."""
    low, high = limits or RANGES[name]
    try:
        number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):  # NaN would pass the range check below
        raise UserError(f"{LABELS[name]} must be a number from {low:g} to {high:g}; got {quoted(value)}.")
    if not low <= number <= high:
        raise UserError(f"{LABELS[name]} must lie between {low:g} and {high:g}; got {number:g}. Nothing was changed.")
    return number


def quoted(value) -> str:
    """A value a client sent, as a one-line message quotes it (short, whatever was sent)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def name_of(what: str, value) -> str:
    """A model's or a method's name: text, or a one-line refusal (a list or a dict sent through the API)."""
    if not isinstance(value, str):
        raise UserError(f"The {what} must be a name (text); got {quoted(value)}.")
    return value


def question_after(value) -> bool:
    """The "when the cache is compressed" control's value -> whether the question comes after."""
    values = [v for _, v in COMPRESS]
    if not isinstance(value, str) or value not in values:
        raise UserError(f"When the cache is compressed must be one of {', '.join(values)}; got {quoted(value)}.")
    return value == "before_question"


def own_params(spec: dict) -> list[dict]:
    """A method's parameters besides the budget (which has its own slider)."""
    return [p for p in spec["params"] if p["name"] != "budget"]


def param_order() -> list[tuple[str, dict]]:
    """(method, param spec) of every method parameter, in the order the controls are built."""
    return [(spec["name"], p) for spec in service.method_specs() for p in own_params(spec)]


def control_names() -> list[str]:
    """The API's parameter name of every control, in ``SettingsPanel.inputs`` order
    (a method's own parameter is ``<method>_<parameter>``)."""
    return list(BASE_CONTROLS) + [f"{method}_{spec['name']}" for method, spec in param_order()]


def settings_from_named(controls: dict) -> service.Settings:
    """Controls' values by :func:`control_names` -> Settings (a missing one: its default; the video
    frames, missing or None: the model's, :func:`kv_arena.service.default_frames`)."""
    defaults = dict(zip(control_names(), control_values(controls.get("model"), controls.get("method") or DEFAULT_METHOD)))
    if controls.get("num_frames", None) is None:
        controls = {**controls, "num_frames": defaults["num_frames"]}
    return settings_from([controls.get(name, defaults[name]) for name in control_names()])


def settings_from(values: Sequence) -> service.Settings:
    """Controls' values (in ``SettingsPanel.inputs`` order) -> Settings."""
    base = dict(zip(BASE_CONTROLS, values))
    params: dict[str, dict] = {}
    for (method, spec), value in zip(param_order(), values[len(BASE_CONTROLS):]):
        params.setdefault(method, {})[spec["name"]] = value
    if base["model"] is None or base["method"] is None:
        raise UserError("Pick a model and a method first.")
    model, method = name_of("model", base["model"]), name_of("method", base["method"])
    service.check_model_allowed(model)
    cap = checked("stream_cap_mb", base["stream_cap_mb"])
    return service.Settings.make(params=service.checked_params(params), model=model, method=method,
                                 budget=checked("budget", base["budget"]),
                                 max_new_tokens=int(checked("max_new_tokens", base["max_new_tokens"])),
                                 num_frames=int(checked("num_frames", base["num_frames"], frame_range(cap))),
                                 question_after=question_after(base["compress"]), stream_cap_mb=cap)


def frame_range(cap_mb: float) -> tuple[int, int]:
    """The frames a video may have: more when it streams under a cap, whose cache stays the same."""
    return STREAMED_FRAMES if cap_mb > 0 else RANGES["num_frames"]


def streaming_methods() -> str:
    return ", ".join(s["title"] for s in service.method_specs() if s.get("streams_under_cap"))


def on_stream_cap(cap_mb, frames):
    """Cap set or cleared: the frames slider's limit, said next to it."""
    try:
        cap = checked("stream_cap_mb", cap_mb)
    except UserError:
        return gr.skip()
    low, high = frame_range(cap)
    info = FRAMES_INFO + (f" Up to {high:,} while streaming under a cap (0 MB: {RANGES['num_frames'][1]})."
                          if cap > 0 else f" Up to {high} in one prompt; set a memory cap to stream up to "
                                          f"{STREAMED_FRAMES[1]:,}.")
    value = min(float(frames), high) if isinstance(frames, (int, float)) else gr.skip()
    return gr.Slider(minimum=low, maximum=high, value=value, info=info)


def control_values(model: str | None = None, method: str = DEFAULT_METHOD, params: dict[str, dict] | None = None,
                   **base) -> list:
    """The controls' values with defaults from the papers (the video frames: the model's), for calling
    event functions directly."""
    model = model or service.default_model()
    values = DEFAULTS | {"model": model, "method": method, "num_frames": service.default_frames(model)} | base
    params = params or {}
    return [values[name] for name in BASE_CONTROLS] + [
        params.get(m, {}).get(spec["name"], spec["default"]) for m, spec in param_order()]


def method_card(name: str) -> str:
    """One paragraph on the chosen method, with its paper."""
    spec = service.method_spec(name)
    paper = f" [Paper]({spec['paper']})" if spec["paper"] else ""
    return f"**{service.shown_title(spec)}**: {spec['summary']}{paper}"


def model_card(name: str) -> str:
    """What the model is, and which methods it is not offered with and why (said once, here)."""
    if service.has_random_weights(name):
        card = (f"**{name}** has **random weights**: its answers are nonsense text. The memory, speed and "
                "kept-token panels are real measurements; pick a hub model on a GPU for real answers.")
    elif service.is_trained_here(name):
        card = f"**{name}**: {service.model_description(name)}"
    else:
        card = f"**{name}**: weights from the Hugging Face Hub."
    return card + "".join(f"\n\n*Not offered with this model:* {why}" for why in refused(name).values())


def refused(model: str) -> dict[str, str]:
    """The methods ``model`` cannot run, with why ({} for a name that is no model: said where it is used)."""
    try:
        return service.refused_methods(model)
    except UserError:
        return {}


def offered(model: str, reference: bool = True) -> list[tuple[str, str]]:
    """(title, name) of the methods that run on ``model`` (the full cache too, with ``reference``), then
    SnapKV stacked on each quantised store (SnapKV + FP8, SnapKV + INT4) where it runs."""
    left_out = refused(model)
    options = [(service.shown_title(s), s["name"]) for s in service.method_specs()
               if s["name"] not in left_out and (reference or not s["is_reference"])]
    stacks = service.stacks_of()  # SnapKV + FP8, SnapKV + INT4
    return options + [(service.title_of(s), s) for s in stacks if service.params_owner(s) not in left_out]


def methods_for_model(model: str, method: str) -> gr.Dropdown:
    """Model changed: the Method picker offers what runs on it, keeping the method picked where it can."""
    choices = offered(model)
    return gr.Dropdown(choices=choices, value=method if method in [n for _, n in choices] else DEFAULT_METHOD)


def control(spec: dict, label: str):
    """One Gradio control for a parameter spec (Param.to_dict())."""
    common = {"label": label, "info": spec["help"], "value": spec["default"]}
    if spec["kind"] == "choice":
        return checked_controls.Dropdown(choices=list(spec["choices"]), **common)
    if spec["kind"] == "bool":
        return gr.Checkbox(**common)
    if spec["kind"] in ("int", "float") and "minimum" in spec and "maximum" in spec:
        step = spec.get("step") or (1 if spec["kind"] == "int" else (spec["maximum"] - spec["minimum"]) / 100)
        return checked_controls.Slider(minimum=spec["minimum"], maximum=spec["maximum"], step=step, **common)
    if spec["kind"] in ("int", "float"):
        return checked_controls.Number(precision=0 if spec["kind"] == "int" else None, **common)
    return gr.Textbox(**common)


@dataclass
class SettingsPanel:
    model: gr.Dropdown
    model_card: gr.Markdown
    method: gr.Dropdown
    method_card: gr.Markdown
    budget: gr.Slider
    max_new_tokens: gr.Slider
    num_frames: gr.Slider
    compress: gr.Radio
    stream_cap: gr.Number | None = None
    realised: gr.Markdown | None = None  # the fraction the method really held, after a message
    groups: dict[str, gr.Group] = field(default_factory=dict)
    params: list = field(default_factory=list)
    advanced: gr.Accordion | None = None  # the method's own parameters, folded

    @property
    def inputs(self) -> list:
        return [self.model, self.method, self.budget, self.max_new_tokens, self.num_frames, self.compress,
                self.stream_cap, *self.params]

    @property
    def named(self) -> dict:
        """The controls by API parameter name (``inputs_kwargs`` of the public events)."""
        return dict(zip(control_names(), self.inputs))


def budget_note(spec: dict) -> str:
    if spec["uses_budget"]:
        return ""
    if spec["is_reference"]:
        return "The full cache keeps everything: no budget."
    return (f"{spec['title']} takes no budget: its own parameters (Advanced) decide what it holds. The fraction of "
            "the full cache it really holds is measured after your message and shown here.")


def realised_note(method: str, fraction: float | None) -> str | None:
    """What the method really held, measured after the prompt (a chat turn's output; None: nothing
    measured)."""
    if fraction is None:
        return None
    return f"**Measured after the prompt:** {method} holds {fraction:.2f}x of the full cache's KV bytes."


BUDGET_INFO = BUDGET_SPEC["help"]
SWITCH_NOTE = ("Switch any time: the conversation stays, and your next message is answered by the new method "
               "after it re-reads the chat (the chat says what that cost). A new model starts a new conversation.")


def budget_slider(name: str, cap_mb) -> gr.Slider:
    """The budget slider for method ``name`` with this streaming cap: hidden for a method without a
    budget; greyed, saying why, where the cap alone sets what the method holds."""
    try:
        spec, cap = service.method_spec(name), checked("stream_cap_mb", cap_mb)
    except (UserError, ValueError):
        return gr.skip()
    ruled = spec["uses_budget"] and cap > 0 and spec["cap_replaces_budget"]
    info = (f"Not used while videos stream under a cap: the cap ({cap:g} MB) alone sets what {spec['title']} "
            "holds. Set the cap to 0 to use the budget." if ruled else BUDGET_INFO)
    return gr.Slider(visible=spec["uses_budget"], interactive=spec["uses_budget"] and not ruled, info=info)


def on_method(name: str, cap_mb=0):
    """Method picked: its card, the budget slider (hidden for methods without a budget, a note
    instead, later the fraction they really hold; greyed where the cap rules), its fold."""
    spec = service.method_spec(name)
    owner = service.params_owner(name)  # a stack shows its selector's parameters, which it takes
    groups = [gr.Group(visible=s["name"] == owner) for s in service.method_specs() if own_params(s)]
    return [method_card(name), budget_slider(name, cap_mb), budget_note(spec), *groups]


def mpic_k_index() -> int | None:
    """Position of MPIC's k among the parameter controls (None without MPIC): the ``k`` of the
    method that reuses stored media."""
    reusing = {s["name"] for s in service.method_specs() if s["reuses_media"]}
    return next((i for i, (m, p) in enumerate(param_order()) if m in reusing and p["name"] == "k"), None)


def mpic_k(name: str) -> int:
    try:
        return service.mpic_default_k(name)
    except UserError:
        return 32  # the paper's; the model cannot load now, and says so when it is used


@dataclass(frozen=True)
class ModelSwitch:
    """What picking a model changes, named as :class:`ModelOutputs` names its values."""

    model: gr.Dropdown
    loaded: gr.State  # the last model that loaded, to fall back to
    model_card: gr.Markdown
    mpic_k: gr.components.Component  # MPIC's k control (a State where no method has one)
    num_frames: gr.Slider
    model_about: gr.Accordion  # the card's fold: opened where it says why a model did not load


@dataclass(frozen=True)
class ModelOutputs(Outputs):
    model: Any = KEEP
    loaded: Any = KEEP
    model_card: Any = KEEP
    mpic_k: Any = KEEP
    num_frames: Any = KEEP
    model_about: Any = KEEP


def frames_for_model(name: str, previous: str, frames) -> Any:
    """The video frames once ``name`` replaces ``previous``: its default where they were the previous
    model's (the user had not set them), else as the user set them (:data:`KEEP`)."""
    unchanged = isinstance(frames, (int, float)) and not isinstance(frames, bool) and \
        frames == service.default_frames(previous)
    return service.default_frames(name) if unchanged or frames is None else KEEP


def on_model(name: str, previous: str, frames=None, progress=gr.Progress()) -> ModelOutputs:
    """Model picked: load it now (with progress), and set MPIC's k for its image size and the video
    frames to its default, unless the user set them (``frames``, the slider's value, differs from the
    previous model's default). On failure keep the previous one and say why, once, under the picker
    (the model card)."""
    try:
        service.get_model(name, lambda f, text: progress(f, desc=text))
    except UserError as exc:
        log.info("user error: %s", exc)
        return ModelOutputs(previous, previous, model_card(previous) + f"\n\n*Could not switch to {name}: {exc}*",
                            model_about=gr.Accordion(open=True))
    return ModelOutputs(name, name, model_card(name), mpic_k(name), frames_for_model(name, previous, frames))


def build_settings() -> SettingsPanel:
    """The sidebar: the model (its description folded) and the settings every tab shares. The
    Method and Budget are made here, unrendered: the Chat tab shows them beside its conversation
    (:func:`render_method_controls`), where a switch is seen to act."""
    specs = service.method_specs()
    first = service.default_model()
    model = checked_controls.Dropdown(choices=service.model_choices(), value=first, label="Model", elem_id="model")
    with gr.Accordion("What this model reads", open=False, elem_id="model-about") as about:
        card = gr.Markdown(model_card(first), elem_id="model-card")
    method = checked_controls.Dropdown(choices=offered(first), value=DEFAULT_METHOD, label="Method", elem_id="method",
                                       render=False)
    info = gr.Markdown(method_card(DEFAULT_METHOD), elem_id="method-card", render=False)
    budget = checked_controls.Slider(*RANGES["budget"], value=DEFAULTS["budget"], step=BUDGET_SPEC["step"], label="Budget",
                                     visible=service.method_spec(DEFAULT_METHOD)["uses_budget"], elem_id="budget",
                                     elem_classes=["range-said"], info=BUDGET_INFO, render=False)
    realised = gr.Markdown(budget_note(service.method_spec(DEFAULT_METHOD)), elem_id="realised", label="Measured",
                           render=False)
    groups, params = {}, []
    with gr.Accordion("Advanced: the method's own parameters", open=False, render=False) as advanced:
        gr.Markdown("The chosen method's parameters appear here (the full cache has none).")
        for spec in specs:
            own = own_params(spec)
            if not own:
                continue
            with gr.Group(visible=spec["name"] == DEFAULT_METHOD) as group:
                paper = f" ([paper]({spec['paper']}))" if spec["paper"] else ""
                gr.Markdown(f"Parameters of **{spec['title']}**{paper}, with the paper's defaults.")
                params += [control(p, p["name"].replace("_", " ")) for p in own]
            groups[spec["name"]] = group
    k = mpic_k_index()
    if k is not None:  # MPIC-k's k suits the model's image size (service.mpic_default_k says how)
        params[k].value = mpic_k(first)
        params[k].info += " Set for the model's image size: at most a quarter of its tokens per 448 px image."
    max_new = checked_controls.Slider(*RANGES["max_new_tokens"], value=DEFAULTS["max_new_tokens"], step=1,
                                      label="Max new tokens", elem_classes=["range-said"])
    frames = checked_controls.Slider(*RANGES["num_frames"], value=service.default_frames(first), step=1, label="Video frames",
                                     elem_classes=["range-said"], elem_id="num-frames",
                                     info=FRAMES_INFO + f" Up to {RANGES['num_frames'][1]} in one prompt; set a "
                                                        f"memory cap to stream up to {STREAMED_FRAMES[1]:,}.")
    compress = checked_controls.Radio(COMPRESS, value=DEFAULTS["compress"], label="When the cache is compressed",
                                      info="A message with media: compressed together with its question, or the media "
                                           "first (prefilled and compressed before the question is known), then the question.",
                                      elem_id="compress")
    stream_cap = checked_controls.Number(value=DEFAULTS["stream_cap_mb"], minimum=0, label="Stream videos under a KV cap (MB)",
                                         elem_id="stream-cap",
                                         info="0: off. Above 0 (Chat): a message's images and video go in a few frames at "
                                              "a time, the cache brought back under this many MB after each chunk, then "
                                              f"the question. Methods that can: {streaming_methods()}; the full cache "
                                              "streams without a cap (the reference).")
    panel = SettingsPanel(model, card, method, info, budget, max_new, frames, compress, stream_cap, realised, groups,
                          params, advanced)
    stream_cap.change(on_stream_cap, [stream_cap, frames], frames, api_visibility="private")
    loaded = gr.State(first)  # the last model that loaded, to fall back to
    method.change(on_method, [method, stream_cap], [info, budget, realised, *groups.values()], api_visibility="private")
    stream_cap.change(budget_slider, [method, stream_cap], budget, api_visibility="private")
    model.change(methods_for_model, [model, method], method, api_visibility="private")
    # .input, not .change: falling back to the previous model must not trigger another load
    k_control = params[k] if k is not None else gr.State()  # without MPIC its value goes nowhere
    switch = ModelSwitch(model, loaded, card, k_control, frames, about)
    model.input(by_component(switch, on_model), [model, loaded, frames], components_of(switch, ModelOutputs), concurrency_id="gpu",
                concurrency_limit=1, api_visibility="private")
    return panel


def render_method_controls(panel: SettingsPanel) -> None:
    """The Method, its Budget, what it does and what it held, what a switch does, and its own
    parameters: rendered where the caller is (the Chat tab, beside the conversation)."""
    for component in (panel.method, panel.budget, panel.method_card, panel.realised):
        component.render()
    gr.Markdown(SWITCH_NOTE, elem_id="switch-note")
    panel.advanced.render()
