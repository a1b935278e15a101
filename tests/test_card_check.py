"""training/card_check.py: the model card's scenes drawn by code of their own, asked the app's way."""

from __future__ import annotations

import numpy as np

from tests.support import training_module

card = training_module("card_check")


def test_a_drawn_scene_holds_its_objects_in_their_colours():
    """Every object is drawn (its colour's pixels are there) and each shape and colour is used once."""
    rng = np.random.default_rng(0)
    for style in card.STYLES:
        image, objects = card.scene(rng, style, 1 if style == "one object" else 5)
        assert image.width % card.CELL == 0 and 24 * card.CELL <= image.height <= 30 * card.CELL
        assert len({s for s, _ in objects}) == len({c for _, c in objects}) == len(objects)
        pixels = {tuple(p) for p in np.asarray(image).reshape(-1, 3)}
        palette = card.WEB if style == "web colours" else card.PAINT
        assert all(palette[c] in pixels for _, c in objects)


def test_the_questions_answer_from_the_objects():
    rng = np.random.default_rng(0)
    objects = [("ring", "orange"), ("cross", "red"), ("square", "blue")]
    assert card.chat_of(rng, "objects", objects)[0] == ("What is in the picture?", "red cross blue square orange ring")
    assert card.chat_of(rng, "pair", objects)[0] == ("What colours are the ring and the cross?", "orange red")
    assert card.chat_of(rng, "colour", objects[:1]) == [("What colour is the ring?", "orange"),
                                                        ("Which shape is orange?", "ring")]
    frames, moving = card.clip(rng)
    assert frames.ndim == 4 and 16 <= len(frames) <= 32 and len(frames) % 2 == 0
    assert not np.array_equal(frames[0], frames[1])  # the first object moves


def test_a_drawing_made_otherwise_is_drawn_varied_and_the_same_from_the_same_seed():
    """Each kind (logo, charts, street, sign) is a picture 320-900 px a side of many colours,
    another each time it is drawn, and the same again from the same seed."""
    first, again = np.random.default_rng(0), np.random.default_rng(0)
    for kind in card.DRAWINGS:
        image = card.drawing(first, kind)
        assert 320 <= image.width <= 900 and 320 <= image.height <= 900 and image.mode == "RGB"
        assert len(image.getcolors(1 << 24)) > 3, kind  # drawn on, not a plain background
        assert image.tobytes() == card.drawing(again, kind).tobytes(), kind
        assert card.drawing(first, kind).tobytes() != image.tobytes(), kind
        card.drawing(again, kind)  # the two streams in step again


def rows_of(out: str) -> list[list[str]]:
    return [line.lstrip("| ").split(" | ")[:2] for line in out.splitlines() if line.startswith("| ") and "/" in line]


def test_the_check_runs_through_the_app_on_the_bundle(capsys):
    """Every style, the video in its turn and before the question, the sample photos and each kind
    of drawing made otherwise get a row; --drawings-only asks the drawings alone."""
    assert card.photos(), "gradio's sample photos are installed with gradio"
    assert card.main(["--items", "1"]) == 0
    assert {drawn for drawn, _ in rows_of(capsys.readouterr().out)} == {*card.STYLES, "moving video", "photo", "drawing"}
    assert card.main(["--drawings-only", "--items", "1", "--bar"]) == 0
    assert rows_of(capsys.readouterr().out) == [["drawing", kind] for kind in (*card.DRAWINGS, "all")]


def test_the_bar_names_each_style_the_video_either_way_and_the_photos_under_it_not_the_drawings():
    right, wrong = [True, True], [False, True]
    tally = {("turned", "colour"): [right] * 9 + [wrong], ("turned", "shape"): [right] * 10,
             ("thick", "colour"): [right] * 8 + [wrong] * 2, ("moving video", "in its turn"): [right] * 10,
             ("moving video", "asked before"): [right] * 8 + [wrong] * 2,
             ("photo", "bus"): [wrong], ("photo", "lion"): [right] * 9, ("drawing", "logo"): [wrong] * 10}
    assert card.bar_misses(tally) == ["thick 0.80", "moving video, asked before 0.80"]
