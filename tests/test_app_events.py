"""The chat's event functions called directly: a turn, multi-turn, stop, new chat, the overlay,
session isolation, the panels, and every bad input (readable message, history kept, next request
served)."""

from __future__ import annotations

import inspect
import re

import gradio as gr
import plotly.graph_objects as go
import pytest
import torch
from PIL import Image
from tests.app_support import MODEL, ask, config, turn
from tests.support import make_image

import backends
import kv_arena.media
from components import about, chat, chat_status, compare, overlay, plots, settings
from kv_arena import service
from kv_arena.errors import UserError
from kv_arena.runtime.generate import Conversation
from kv_arena.service import model_pool


def test_settings_round_trip_every_registered_method():
    names = [s["name"] for s in service.method_specs()]
    assert names[0] == "full" and "streamingllm" in names
    values = settings.control_values(model=MODEL, method="streamingllm", budget=0.3,
                                     params={"streamingllm": {"sink_tokens": 2}})
    s = settings.settings_from(values)
    assert (s.model, s.method, s.budget) == (MODEL, "streamingllm", 0.3)
    assert s.method_params("streamingllm") == {"sink_tokens": 2}
    assert service.plan_turn(s).backend.sink_tokens == 2
    with gr.Blocks():  # one control per parameter of every method, and a fold per method that has any
        panel = settings.build_settings()
    assert len(panel.params) == len(settings.param_order())
    assert len(settings.on_method("streamingllm")) == 3 + len(panel.groups)


def test_a_method_without_budget_hides_the_slider_and_shows_what_it_holds(media):
    for name in ("full", "mpic", "streamingllm"):
        card, budget, note, *groups = settings.on_method(name)
        uses = backends.backend_class(name).uses_budget
        assert budget.visible is uses and (note == "") is uses
    session = service.Session()
    outputs, error = turn(session, ask("What is this?", media["image"]), method="mpic")
    realised = outputs[-1].realised
    assert error is None and re.search(r"MPIC.* holds \d\.\d\dx of the full cache's KV bytes", realised)


def test_a_budget_the_cap_overrules_is_greyed_with_the_reason():
    ruled = settings.budget_slider("infinipot_v", 2)
    assert ruled.interactive is False and "Not used while videos stream under a cap" in ruled.info
    free = settings.budget_slider("infinipot_v", 0)
    assert free.interactive is True and free.info == settings.BUDGET_INFO
    snap = settings.budget_slider("snapkv", 2)  # SnapKV holds min(budget, cap): its budget still applies
    assert snap.interactive is True
    assert settings.on_method("infinipot_v", 2)[1].interactive is False


def test_chat_turn_streams_text_panels_and_overlay(media, monkeypatch):
    monkeypatch.setattr(chat, "TEXT_EVERY_S", 0.0)  # every token sent (the app sends at most every 0.1 s)
    session = service.Session()
    outputs, error = turn(session, ask("What is this?", media["image"]), max_new_tokens=6)
    assert error is None and len(outputs) >= 3  # the echo, then one update per token
    last = outputs[-1]
    history, status, memory, speed, layers, picker, gallery, scale, realised = (
        last.chatbot, last.status, last.memory, last.speed, last.layers, last.layer_picker, last.gallery,
        last.scale_line, last.realised)
    assert history[0]["role"] == "user" and history[-1]["role"] == "assistant" and history[-1]["content"]
    assert outputs[0].textbox == chat.EMPTY_INPUT  # the input box empties as soon as the message is taken
    assert "StreamingLLM" in status and "saved" in status and "random weights" in status
    assert re.search(r"after the prompt it held 0\.\d\dx of the full KV", status)
    assert "Qwen2.5-VL-7B-Instruct" in scale and "16 GiB fits" in scale
    assert "StreamingLLM holds 0." in realised
    assert isinstance(memory, go.Figure) and [t.name for t in memory.data][0] == "Full cache"
    assert re.fullmatch(r"StreamingLLM: \d+% saved", memory.data[1].name)  # the saving in the legend, never overlapping
    assert re.search(r"model time [\d.]+ s \+ [\d.]+ s for the full-cache reference", status)
    assert [t.y for t in speed.data][0] == ("Full cache", "StreamingLLM")
    assert len(layers.data[0].y) == 4  # four layers in the tiny model
    assert picker.choices[0][0] == overlay.MEAN
    assert len(gallery) == 1 and gallery[0][1] is None  # the caption is drawn under the picture, not over it
    assert re.fullmatch(r"image 1: \d+% of 16 kept", overlay.captions(session.visuals)[0])
    assert Image.open(gallery[0][0]).height > 16 * 4  # the picture, then the caption's strip
    # the layer picker redraws from the session, without running the model
    assert "layer 2" in overlay.captions(session.visuals, "layer 2")[0] and chat.show_layer(session, "layer 2")


def test_multi_turn_continues_and_a_model_change_starts_a_new_conversation(media):
    session = service.Session()
    first, _ = turn(session, ask("Describe.", media["image"]))
    history = first[-1].chatbot
    second, error = turn(session, ask("And the colours?"), history)
    assert error is None and second[-1].chatbot[: len(history)] == history
    assert not any(m.get("metadata") for m in second[-1].chatbot)  # same cache, no divider
    assert len(session.history) == 2
    third, _ = turn(session, ask("Again?"), second[-1].chatbot, model="tiny-qwen3-vl")
    assert third[-1].chatbot[len(second[-1].chatbot)]["metadata"]["title"] == "New conversation"
    assert len(session.history) == 1


def test_any_question_about_the_scenes_objects_is_marked_and_another_says_why_not():
    session = service.Session()
    scene = str(chat.ASSETS / "scene_colour.png")  # v3's colour example: a red triangle, a yellow cross, a purple circle, an orange square
    outputs, error = turn(session, ask("What colour is the triangle?", scene), model="tiny-arena-vl", method="full")
    assert error is None and re.search(r"✓ \*\*right\*\*|✗ \*\*wrong\*\* \(true: red\)", outputs[-1].status)
    history = outputs[-1].chatbot
    outputs, error = turn(session, ask("How many shapes are there?"), history, model="tiny-arena-vl", method="full")
    assert error is None and "not marked: the scene answers the colour of a shape" in outputs[-1].status
    assert "right" not in outputs[-1].status and "wrong" not in outputs[-1].status


@pytest.mark.parametrize("first,change", [
    (dict(method="full"), dict(method="snapkv", budget=0.5)),  # the method
    (dict(method="snapkv", budget=0.8), dict(method="snapkv", budget=0.5)),  # its budget
    (dict(method="h2o", budget=0.5), dict(method="h2o", budget=0.5, params={"h2o": {"recent_share": 0.25}})),  # a knob
])
def test_switching_the_method_keeps_the_conversation(first, change):
    """The method, its budget or a knob changed mid-conversation: the new method re-reads the turns
    so far (the picture, the questions, the answers as given) and answers the next question about
    the same picture from its own cache; the chat says so in one line, with the re-read's cost."""
    session = service.Session()
    scene = str(chat.ASSETS / "scene_colour.png")
    outputs, error = turn(session, ask("What colour is the circle?", scene), model="tiny-arena-vl", **first)
    assert error is None and "**right**" in outputs[-1].status
    history, held = outputs[-1].chatbot, session.conv
    second, error = turn(session, ask("Which shape is red?"), history, model="tiny-arena-vl", **change)
    assert error is None
    shown = second[-1].chatbot
    assert shown[: len(history)] == history and not any(m.get("metadata", {}).get("title") == "New conversation"
                                                         for m in shown)
    line = shown[len(history)]
    assert line["metadata"]["title"] == chat.SWITCHED and re.search(r"re-read the 1 turn above \(\d+ tokens", line["content"])
    assert shown[-1]["content"] == "triangle" and "**right**" in second[-1].status
    assert len(session.history) == 2 and len(session.chat.answers) == 2
    assert session.transcript == chat.transcript(shown)  # the next message continues this conversation
    if first["method"] == "full":  # the full cache's chat is the reference from then on: continued, not recomputed
        assert session.chat.references.conv is held
    third, error = turn(session, ask("What colour is the circle?"), shown, model="tiny-arena-vl", **change)
    assert error is None and not any(m.get("metadata") for m in third[-1].chatbot[len(shown):])
    assert len(session.history) == 3


def test_full_cache_reference_is_cached_per_input(media):
    session = service.Session()
    turn(session, ask("What is this?", media["image"]), method="full")
    chat.clear(session)
    outputs, _ = turn(session, ask("What is this?", media["image"]))
    assert "cached" in outputs[-1].status
    assert outputs[-1].speed.data[0].y[0] == "Full cache (cached)"


def test_stop_ends_the_answer_and_keeps_the_chat_usable(media, monkeypatch):
    monkeypatch.setattr(chat, "TEXT_EVERY_S", 0.0)  # every token is sent, so Stop lands mid-answer
    session = service.Session()
    events = chat.respond(ask("Talk a lot.", media["image"]), [], session, config(max_new_tokens=40))
    next(events), next(events)  # the echo, then the first token
    chat.stop(session)
    last = list(events)[-1]
    assert int(re.search(r"(\d+) new tokens", last.status).group(1)) < 40
    outputs, error = turn(session, ask("Go on."), last.chatbot)
    assert error is None and len(session.history) == 2


def test_new_chat_clears_history_panels_and_cache(media):
    session = service.Session()
    turn(session, ask("Hi", media["image"]))
    outputs = chat.clear(session)
    assert outputs.chatbot == [] and outputs.memory is None and outputs.gallery is None
    assert session.conv is None and session.history == [] and session.visuals == []


def test_video_turn_draws_its_frames_in_rows_with_a_caption_that_stays_legible(media):
    session = service.Session()
    outputs, error = turn(session, ask("Where does the ball go?", media["video"]), num_frames=4)
    assert error is None
    image = Image.open(outputs[-1].gallery[0][0])
    caption = max(overlay.CAPTION_PX, image.width // 40)
    assert "video" in overlay.captions(session.visuals)[0] and image.width > 2 * (image.height - caption - 10)  # 2 temporal tokens side by side, the caption under
    tiles = [Image.new("RGB", (300, 300)) for _ in range(16)]
    grid = overlay.frame_grid(tiles)
    assert grid.size == (4 * 300 + 3 * 6, 4 * 300 + 3 * 6)  # 16 frames: four rows of four, not a 4,800 px strip
    drawn = overlay.with_caption(Image.new("RGB", (4800, 300)), "video 1")
    assert drawn.height - 300 >= 4800 // 40  # a wide picture, shown shrunk, gets a caption that stays legible


def test_sessions_are_isolated(media):
    a, b = service.Session(), service.Session()
    turn(a, ask("Mine.", media["image"]))
    assert b.conv is None and b.history == [] and not b.chat.references.results
    chat.stop(b)
    assert not a.stop_requested
    service.track(a, "tab-a")
    service.release("tab-a")  # closing the tab frees its caches
    assert a.conv is None and not a.chat.references.results


@pytest.mark.parametrize("case, expected", [
    ("empty", "The message is empty"),
    ("corrupt", "is not a readable image"),
    ("fake_video", "is not a video that can be decoded"),
    ("too_long", "the limit is 1 s"),
    ("too_big", "larger than the 1 MB"),
])
def test_bad_input_gives_a_message_and_the_next_request_succeeds(media, monkeypatch, case, expected):
    monkeypatch.setattr(kv_arena.media, "MAX_VIDEO_SECONDS", 1.0 if case == "too_long" else 600.0)
    monkeypatch.setattr(kv_arena.media, "MAX_VIDEO_BYTES", 2**20)
    message = {"empty": ask("   "), "corrupt": ask("Look", media["corrupt"]), "fake_video": ask("Watch", media["fake_video"]),
               "too_long": ask("Watch", media["video"]), "too_big": ask("Watch", media["big_video"])}[case]
    session = service.Session()
    history, _ = turn(session, ask("First.", media["image"]))
    history = history[-1].chatbot
    outputs, error = turn(session, message, history)
    assert error is not None and expected in error
    # said once, in the status line: the chat as it was, the panels untouched, the files out of the box
    (refused,) = outputs
    assert refused.chatbot == history and refused.textbox == {"text": message["text"], "files": []}
    assert set(refused.changed()) == {"chatbot", "textbox", "status"}
    outputs, error = turn(session, ask("Still there?"), history)
    assert error is None and outputs[-1].chatbot[: len(history)] == history and len(session.history) == 2


def test_model_that_fails_to_load(media, monkeypatch):
    real = model_pool.load_model

    def broken(name, **kw):
        if name.startswith("random:"):
            raise RuntimeError("weights file truncated")
        return real(name, **kw)

    monkeypatch.setattr(model_pool, "load_model", broken)
    monkeypatch.setenv("KV_ARENA_RANDOM_MODELS", "1")  # an operator's setting: random: architectures allowed
    name = "random:Qwen/Qwen2-VL-2B-Instruct"
    switched = settings.on_model(name, MODEL)
    chosen, kept, card = switched.model, switched.loaded, switched.model_card
    assert (chosen, kept) == (MODEL, MODEL) and "weights file truncated" in card
    session = service.Session()
    values = settings.control_values(model=name, method="streamingllm", max_new_tokens=4)
    outputs = list(chat.respond(ask("Hi", media["image"]), [], session, settings.settings_from(values)))
    assert "failed to load: RuntimeError: weights file truncated" in outputs[-1].status
    assert outputs[-1].chatbot == [] and outputs[-1].textbox == ask("Hi", media["image"])  # history and message back
    assert turn(session, ask("Hi", media["image"]))[1] is None


def test_out_of_memory_frees_the_cache_and_keeps_serving(media, monkeypatch):
    session = service.Session()
    first, _ = turn(session, ask("First.", media["image"]))
    history = first[-1].chatbot
    real = Conversation.stream

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield  # a generator, like the real one

    monkeypatch.setattr(Conversation, "stream", oom)
    outputs, error = turn(session, ask("Second.", media["image2"]), history)
    assert "Out of GPU memory" in error and outputs[-1].chatbot == history
    assert session.conv is None
    monkeypatch.setattr(Conversation, "stream", real)
    outputs, error = turn(session, ask("Third."), history)  # the chat shown is re-read: its picture is back
    assert error is None and outputs[-1].chatbot[len(history)]["metadata"]["title"] == "History re-read"
    assert len(session.history) == 2


@pytest.mark.parametrize("name, value", [("budget", 5), ("budget", -1), ("budget", 0), ("max_new_tokens", 0),
                                         ("num_frames", 99)])
def test_out_of_range_settings_are_said_not_clamped(media, name, value):
    values = settings.control_values(model=MODEL, method="streamingllm", **{name: value})
    with pytest.raises(UserError, match="must lie between"):
        settings.settings_from(values)
    named = dict(zip(settings.control_names(), values))
    outputs = list(chat.submit(ask("Hi", media["image"]), [], service.Session(), None, None, **named))
    assert outputs[-1].status.startswith(chat.NOT_ANSWERED) and "must lie between" in outputs[-1].status


def test_a_question_without_media_to_the_trained_model_gets_a_hint():
    hint = service.media_hint("tiny-arena-vl", [service.prepare("What colour is the circle?", [])])
    assert "only answers questions about its kind of scenes" in hint
    assert service.media_hint("tiny-qwen2-vl", [service.prepare("Hi", [])]) == ""
    with_scene = service.prepare("What colour is the circle?", [str(chat.ASSETS / "scene_colour.png")])
    assert service.media_hint("tiny-arena-vl", [with_scene]) == ""
    outputs, error = turn(service.Session(), ask("What colour is the circle?"), method="full", model="tiny-arena-vl")
    assert error is None and "Hint: tiny-arena-vl only answers questions about its kind of scenes" in outputs[-1].status


def test_an_upload_to_the_trained_model_gets_the_line_that_it_reads_only_its_scenes(media):
    outputs, error = turn(service.Session(), ask("What colour is the circle?", media["image"]), method="full",
                          model="tiny-arena-vl")
    assert error is None and "reads only its own kind of scenes" in outputs[-1].status
    assert "reads only" not in service.media_hint("tiny-qwen2-vl", [service.prepare("Hi", [media["image"]])])


def test_an_image_over_the_limits_is_refused_before_decoding(tmp_path, monkeypatch):
    """The issue's 8000 x 8000 PNG (solid: 200 KB on disk, 192 MB decoded): a message, and the
    resident memory stays within 10% of what it was."""
    psutil = pytest.importorskip("psutil")
    big = tmp_path / "big.png"
    from PIL import Image
    Image.new("RGB", (8000, 8000), (200, 30, 30)).save(big)
    process = psutil.Process()
    before = process.memory_info().rss
    session = service.Session()
    outputs, error = turn(session, ask("What is it?", str(big)))
    assert error is not None and "8000 x 8000 pixels" in error
    assert process.memory_info().rss < 1.1 * before
    monkeypatch.setattr(kv_arena.media, "MAX_IMAGE_BYTES", 1000)
    outputs, error = turn(session, ask("What is it?", str(big)))
    assert "larger than the" in error


def test_a_large_image_within_the_limits_is_downscaled_at_load(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_arena.media, "LOAD_PIXELS", 100 * 100)
    path = tmp_path / "wide.png"
    make_image(4, (400, 100)).save(path)
    image = kv_arena.media.load_image(str(path))
    assert image.size == (200, 50)  # the aspect ratio kept, at most LOAD_PIXELS


def test_outputs_reach_gradio_keyed_by_component_and_leave_the_rest_as_it_is():
    from components import compare, outputs

    with gr.Blocks():
        tab = compare.CompareTab(*[gr.Textbox() for _ in range(4)], answers=[gr.Textbox() for _ in range(compare.SLOTS)],
                                 table=gr.Dataframe(), status=gr.Markdown(), memory=gr.Plot(), speed=gr.Plot(),
                                 layers=gr.Plot(), quality=gr.Plot(), gallery=gr.Gallery(), at_scale=gr.Markdown(),
                                 notes=gr.Markdown())
    sent = compare.CompareOutputs(answers=list("abcde"), status="Done.")
    assert outputs.keyed(tab, sent) == {**dict(zip(tab.answers, "abcde")), tab.status: "Done."}
    assert tab.outputs == [*tab.answers, tab.table, tab.status, tab.memory, tab.speed, tab.layers, tab.quality,
                           tab.gallery, tab.at_scale, tab.textbox, tab.notes]  # the API's order of results
    wired = outputs.by_component(tab, compare.run)
    assert inspect.signature(wired) == inspect.signature(compare.run)  # Gradio reads the API's parameters from it


def test_overlay_shades_dropped_tokens():
    import numpy as np

    keep = np.ones((2, 1, 4, 4), np.float32)
    keep[:, 0, :2] = 0.0  # top half dropped in every layer
    visual = service.KeptVisual("turn 1, image 1", "image", "kept", [np.full((64, 64, 3), 200, np.uint8)], keep)
    image, caption = overlay.render(visual)
    assert caption == "turn 1, image 1: 50% of 16 kept"
    pixels = np.asarray(image)
    assert pixels[: pixels.shape[0] // 2].mean() < pixels[pixels.shape[0] // 2:].mean()
    assert overlay.layer_index("layer 2") == 1 and overlay.layer_index(overlay.MEAN) is None


def test_projection_at_real_scale_is_plain_arithmetic_on_the_configs():
    from kv_arena.service import at_scale

    arch = next(a for a in at_scale.architectures() if a.name == "Qwen/Qwen2-VL-2B-Instruct")
    assert arch.bytes_per_token == 2 * 28 * 2 * 128 * 2  # 28 KiB, as the About tab says
    p = at_scale.project(arch, 0.25, 1000, memory_bytes=2**30)
    assert p.prompt_full_bytes == 1000 * 28 * 1024 and p.prompt_method_bytes == 250 * 28 * 1024
    assert p.fit_full_tokens == 2**30 // (28 * 1024) and p.fit_method_tokens == 4 * p.fit_full_tokens
    assert p.fit_full_frames == p.fit_full_tokens // 128
    llava = next(a for a in at_scale.architectures() if a.name == "llava-hf/llava-1.5-7b-hf")
    assert llava.bytes_per_token == 2 * 32 * 32 * 128 * 2  # no grouped-query attention: 512 KiB a token
    from components.at_scale import scale_line
    assert scale_line("H2O", None, 100) == "" and scale_line("H2O", 0.5, 100).startswith("*Computed, not measured:*")


def test_examples_are_those_of_the_selected_model():
    trained = chat.examples("tiny-arena-vl")
    long = service.long_example()  # its scenes, then the minute-long video
    assert [(e[0]["text"], [p.rsplit("/", 1)[-1] for p in e[0]["files"]]) for e in trained] == \
        [(q, files) for q, files in service.arena_examples()] + [(long.question, ["scene_long.mp4"])]
    general = chat.examples(MODEL)
    assert len(general) == 4 and not any("arena_" in f for e in general for f in e[0]["files"])
    shown = chat.show_examples("tiny-arena-vl")
    assert shown[0].visible is True and shown[1].visible is False


def test_a_speed_ratio_is_shown_only_with_enough_timed_events_and_outside_the_noise():
    from components import plots

    def drawn(ttft=0.5, steps=(0.010,) * 10):
        return plots.Drawn("H2O", service.Meters(ttft_s=ttft, step_s=list(steps)))

    full = drawn()
    assert plots.vs_full(50, 100) == "0.50x" and plots.vs_full(100, 100) == "1.00x"  # bytes: exact
    assert plots.speed_ratio(drawn(steps=(0.005,) * 10), full, "decode_tok_s") == 2.0
    assert plots.speed_ratio(drawn(steps=(0.012,) * 10), full, "decode_tok_s") == plots.NOT_TOLD  # within 35%
    # a 3-token answer (2 steps) is too short to time, however far apart its steps look
    assert plots.speed_ratio(drawn(steps=(0.040, 0.050)), full, "decode_tok_s") == plots.TOO_SHORT
    noisy = drawn(steps=(0.001, 0.030, 0.002, 0.040, 0.001, 0.030, 0.002, 0.040))  # a "finding" in noise
    assert plots.speed_ratio(noisy, full, "decode_tok_s") == plots.NOT_TOLD
    assert plots.speed_ratio(drawn(ttft=0.05), drawn(ttft=0.02), "ttft_s") == plots.TOO_SHORT  # one short event
    assert plots.speed_ratio(drawn(ttft=1.0), full, "ttft_s") == 2.0
    busy = drawn(ttft=1.0, steps=(0.01, 0.03) * 5)  # uneven steps: the machine was busy, one event says little
    assert plots.speed_ratio(busy, full, "ttft_s") == plots.TOO_SHORT
    assert plots.speed_ratio(drawn(ttft=0.6), full, "ttft_s") == plots.NOT_TOLD
    assert plots.speed_ratio(drawn(ttft=1.0), drawn(ttft=0.3), "ttft_s") == plots.TOO_SHORT
    figure = plots.speed_figure([plots.Drawn("H2O", service.Meters(ttft_s=0.02, step_s=[0.01]))],
                                plots.Drawn("Full cache", service.Meters(ttft_s=0.01, step_s=[0.01])))
    assert any(plots.TOO_SHORT in a.text and "<br>" in a.text for a in figure.layout.annotations)
    assert not any(re.search(r"\dx", label) for trace in figure.data for label in trace.text)
    assert [list(trace.x) for trace in figure.data] == [[0.01, 0.02], [0.0, 0.0]]  # every method's bar...
    assert all(list(t.marker.opacity) == [1.0, plots.UNTOLD_OPACITY] for t in figure.data)  # ...pale where no ratio is told


def test_a_right_first_answer_with_part_of_the_picture_dropped_says_why_beside_it():
    scene = str(chat.ASSETS / "scene_colour.png")
    outputs, error = turn(service.Session(), ask("What colour is the circle?", scene), method="snapkv", budget=0.2,
                          model="tiny-arena-vl")
    status = outputs[-1].status
    assert error is None and "✓ **right**" in status
    assert "Why right although SnapKV dropped part of the picture" in status and "Before the question" in status
    full, _ = turn(service.Session(), ask("What colour is the circle?", scene), method="full", model="tiny-arena-vl")
    assert "Why" not in full[-1].status  # nothing dropped, nothing to explain


def test_each_turn_builds_its_method_once(media, monkeypatch):
    """One plan per turn: the chat builds the picked method once per message (whether the message
    starts the conversation, continues it or switches it), a comparison once per method compared."""
    built: list[str] = []
    for name in ("snapkv", "h2o", "streamingllm"):
        cls = backends.backend_class(name)
        original = cls.__post_init__
        monkeypatch.setattr(cls, "__post_init__", lambda self, original=original: (built.append(self.name), original(self))[1])
    session = service.Session()
    outputs, error = turn(session, ask("What is this?", media["image"]), method="snapkv", budget=0.5)
    assert error is None and built == ["snapkv"]
    history = outputs[-1].chatbot
    outputs, error = turn(session, ask("And then?"), history, method="snapkv", budget=0.5)  # continued
    assert error is None and built == ["snapkv"] * 2
    _, error = turn(session, ask("Again?"), outputs[-1].chatbot, method="h2o", budget=0.5)  # switched: re-read
    assert error is None and built == ["snapkv"] * 2 + ["h2o"]
    built.clear()
    views = list(service.compare(service.Session(), config("snapkv"), ["h2o", "streamingllm"],
                                 service.prepare("What is this?", [media["image"]])))
    assert views[-1].done and sorted(built) == ["h2o", "streamingllm"]


def test_a_method_is_offered_only_on_models_where_it_runs_and_the_card_says_why_once(media):
    """VisionZip reads a CLIP tower's CLS attention (LLaVA-1.5): the pickers leave it out for a
    Qwen-VL model, the model card says why once, and a LLaVA-1.5 model offers it again (read from
    the models' configs: no weights load, nothing downloads)."""
    assert set(service.refused_methods("tiny-qwen2-vl")) == {"visionzip"} == set(service.refused_methods(service.ARENA))
    # Downsample: a LLaVA processor sizes every picture to one grid (a smaller picture makes as many tokens)
    assert set(service.refused_methods("tiny-llava")) == {"downsample"} == set(service.refused_methods("llava-hf/llava-1.5-7b-hf"))
    assert "visionzip" not in service.methods_on("tiny-qwen2-vl") and "visionzip" in service.methods_on("tiny-llava")
    picker = settings.methods_for_model("tiny-qwen2-vl", "visionzip")
    assert "visionzip" not in [n for _, n in picker.choices] and picker.value == settings.DEFAULT_METHOD
    assert settings.methods_for_model("tiny-qwen2-vl", "snapkv").value == "snapkv"
    assert settings.methods_for_model("tiny-llava", "visionzip").value == "visionzip"
    card = settings.model_card("tiny-qwen2-vl")
    assert card.count("Not offered with this model") == 1 and "VisionZip" in card and "CLS token" in card
    llava = settings.model_card("tiny-llava")
    assert llava.count("Not offered") == 1 and "Downsample" in llava and "VisionZip" not in llava
    boxes = compare.methods_for_model("tiny-qwen2-vl", ["snapkv", "visionzip"])
    assert boxes.value == ["snapkv"] and "visionzip" not in [n for _, n in boxes.choices]
    assert "visionzip" in [n for _, n in compare.methods_for_model("tiny-llava", ["snapkv"]).choices]
    # what the pickers offer is what runs: the engine refuses it on the one, answers on the other
    _, error = turn(service.Session(), ask("What is this?", media["image"]), method="visionzip",
                    params={"visionzip": {"keep": 0.5}})
    assert error is not None and service.refused_methods("tiny-qwen2-vl")["visionzip"][:-1] in error
    _, error = turn(service.Session(), ask("What is this?", media["image"]), method="visionzip", model="tiny-llava",
                    params={"visionzip": {"keep": 0.5}})
    assert error is None


def test_the_words_say_what_happened():
    """A budget-only change says the new budget; a method is said to do what it does (KIVI quantises);
    the line computed at real scale counts the whole conversation on a follow-up; the About tab says
    which figures are computed, asks "When do the methods differ?" once and describes each method in
    one plain sentence."""
    session = service.Session()
    scene = str(chat.ASSETS / "scene_colour.png")
    arena = dict(model="tiny-arena-vl", method="snapkv")
    first, error = turn(session, ask("What colour is the circle?", scene), budget=0.8, **arena)
    second, error = turn(session, ask("What colour is the cross?"), first[-1].chatbot, budget=0.5, **arena)
    line = second[-1].chatbot[len(first[-1].chatbot)]
    assert error is None and line["content"].startswith("Now held by SnapKV at a budget of 0.50:")
    scale = second[-1].scale_line
    counted = int(re.search(r"\(full cache → SnapKV, ([\d,]+) tokens in the conversation so far\)", scale)[1].replace(",", ""))
    assert counted > session.history[-1].message.text.count(" ") + 16  # the picture's tokens are in it
    assert "this conversation" in scale and "prompt tokens" not in scale
    assert chat_status.what_it_did("kivi") == "stored the picture in fewer bits"
    assert chat_status.what_it_did("snapkv") == "dropped part of the picture"
    assert chat_status.what_it_did("zipvl") == "dropped part of the picture and stored the picture in fewer bits"
    page = about.INTRO + about.PANELS
    assert page.count("When do the methods differ?") == 1 and "Every memory and speed figure is measured" not in page
    assert "*computed, not measured*" in page
    table = about.methods_table()
    assert not re.search(r"\b(TaR|VaN|tau|probes)\b", table)
    rows = table.splitlines()[2:]
    sentences = [r.strip("| ").split(" | ")[-1] for r in rows]
    assert len(rows) == len(service.method_specs()) and all(". " not in t and t.endswith(".") for t in sentences)


def test_the_panels_fit_a_half_width_panel_at_1280_px():
    """In plotly terms: a 2-token answer's memory panel ticks whole tokens only; the streaming
    memory panel's x title fits half of a 1280 px page (~600 px of 12 px text); the quality panel's
    legend sits under the plot, clear of the panel's own label at its top left."""
    two = plots.memory_figure([plots.Drawn("H2O", service.Meters(kv_trace=[100, 120, 140]))],
                              plots.Drawn("Full cache", service.Meters(kv_trace=[200, 220, 240])))
    assert two.layout.xaxis.dtick == 1 and two.layout.xaxis.tick0 == 0
    long = plots.memory_figure([plots.Drawn("H2O", service.Meters(kv_trace=list(range(1, 40))))])
    assert long.layout.xaxis.dtick is None and long.layout.xaxis.tickformat == "d"
    stream = service.StreamView(frames=[2, 4], kv_bytes=[100, 120], peak_kv_bytes=[110, 130], frames_total=4,
                                cap_bytes=150, capped=True)
    streamed = plots.memory_figure([plots.Drawn("H2O", service.Meters(kv_trace=[120, 130, 140]), stream=stream)])
    assert len(streamed.layout.xaxis.title.text) * 7 < 540  # ~7 px a character at 12 px: inside half of 1280 px
    quality = plots.quality_figure(())
    assert quality.layout.legend.y < 0 and quality.layout.legend.yanchor == "top" and quality.layout.margin.b >= 100
