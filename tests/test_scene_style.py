"""A picture a visitor draws in the offline model's scenes' style (coloured shapes on a plain
background) is not told it is none of the model's scenes; a photo, noise or a blank picture is.
The pictures are drawn here with PIL, as a visitor's paint program would, not by the project's
scene drawing (kv_arena/tiny/scene_drawing.py)."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw
from tests.app_support import ask, config
from tests.support import make_image

from components import chat, compare
from kv_arena import service

ARENA = "tiny-arena-vl"
NOT_ONE = "does not look like one"


def drawn(path, background=(246, 244, 238), size=(480, 360), fmt="PNG") -> str:
    """Four shapes in a paint program's named colours, filled, on a plain background."""
    image = Image.new("RGB", size, background)
    d = ImageDraw.Draw(image)
    d.ellipse((40, 40, 140, 140), fill=(255, 0, 0))  # a red circle
    d.rectangle((300, 50, 390, 140), fill=(0, 0, 255))  # a blue square
    d.polygon([(200, 330), (140, 220), (260, 220)], fill=(255, 215, 0))  # a gold triangle
    d.rectangle((360, 230, 440, 250), fill=(0, 128, 0))  # a green cross
    d.rectangle((390, 200, 410, 280), fill=(0, 128, 0))
    image.save(path, fmt, **({"quality": 70} if fmt == "JPEG" else {}))
    return str(path)


def hint(*files, text="What colour is the circle?") -> str:
    return service.media_hint(ARENA, [service.prepare(text, [str(f) for f in files])])


@pytest.mark.parametrize("background, fmt", [((246, 244, 238), "PNG"), ((40, 40, 48), "JPEG"), ((170, 200, 215), "PNG")])
def test_a_picture_drawn_in_the_scenes_style_is_the_models_kind(tmp_path, background, fmt):
    said = hint(drawn(tmp_path / f"mine.{fmt.lower()}", background, fmt=fmt))
    assert NOT_ONE not in said and "reads only" not in said
    assert said.startswith(f"Note: drawn like {ARENA}'s scenes") and "not marked" in said


def test_several_pictures_one_of_them_blank_are_the_models_kind_but_a_blank_alone_is_not(tmp_path):
    blank = tmp_path / "blank.png"
    Image.new("RGB", (320, 320), (200, 200, 200)).save(blank)
    assert NOT_ONE not in hint(drawn(tmp_path / "a.png"), blank)  # an image scene may show background alone
    assert NOT_ONE in hint(blank)  # nothing drawn: nothing to ask about


def test_a_photo_or_noise_is_still_told_it_is_not_the_models_kind(tmp_path):
    noise = tmp_path / "noise.png"
    make_image(5, (224, 224)).save(noise)
    for path in (noise, chat.ASSETS / "street.png", chat.ASSETS / "chart.png"):
        said = hint(path)
        assert "reads only its own kind of scenes" in said and NOT_ONE in said, path


def test_the_apps_own_scene_needs_no_note():
    assert hint(chat.ASSETS / "scene_colour.png") == ""  # known by its content: its answers are marked


def test_compare_on_a_drawn_picture_says_it_may_read_it(tmp_path):
    last = list(compare.respond(ask("What colour is the circle?", drawn(tmp_path / "mine.png")), ["snapkv"],
                                service.Session(), config("full", model=ARENA, max_new_tokens=3)))[-1]
    assert last.status.startswith("Done") and f"drawn like {ARENA}'s scenes" in last.status and NOT_ONE not in last.status
