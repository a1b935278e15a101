"""Which generation of tiny-arena-vl the app serves, and what goes with it: the one seam between
the weights and everything that must match them (the model built for them, the scenes the app
draws and marks, the benchmarks' questions). The weights' config.json decides (``arena_version``),
so copying a new generation's weights into assets/tiny-arena-vl is all it takes to switch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import arena_model, arena_scenes, arena_v3_model, drawn_scenes, long_videos

*_OTHERS, _LAST = arena_scenes.COLOURS
_THINGS = f"{', '.join(arena_scenes.SHAPES)} in {', '.join(_OTHERS)} or {_LAST}"  # the same in v2 and v3


@dataclass(frozen=True)
class Generation:
    number: int  # config.json's arena_version
    scenes: ModuleType  # QUESTION_TYPES, held_out, fresh, examples, WORDS, SHAPES, COLOURS
    config: Callable  # () -> the model's config
    tokenizer: Callable  # () -> its word-level tokenizer
    image_processor: Callable  # () -> its image processor
    reads: str  # what the model can and cannot read, for the app
    # frames the app feeds from a video: every frame of the generation's longest (a video token
    # merges frames 2g and 2g+1, and its videos were trained whole, so sampling fewer puts frames
    # that were never neighbours into one token)
    video_frames: int
    # () -> (item, files in assets/): a video of a minute or more, streamed under a KV cap (None: none)
    long_example: Callable | None = None


GENERATIONS = {
    2: Generation(2, arena_scenes, arena_model.arena_config, arena_model.tokenizer, arena_model.arena_image_processor,
                  f"It reads a few coloured shapes ({_THINGS}) on a tile grid, one object per cell, on a plain or "
                  "lightly textured background: ask 'What colour is the triangle?' or 'Which shape is blue?' about "
                  "one picture or several, or 'Which shape moves?' about a short video, and again about another "
                  "shape in the same chat. It answers with one word; photos, text, charts and other questions get "
                  "nonsense.",
                  video_frames=max(arena_scenes.VIDEO_FRAMES)),
    3: Generation(3, drawn_scenes, arena_v3_model.arena_config, arena_v3_model.tokenizer,
                  arena_v3_model.image_processor,
                  f"It reads drawn coloured shapes ({_THINGS}) at any position on plain or textured backgrounds, "
                  "each at least one visual token across (28 px once the picture is processed; smaller ones it "
                  "misreads), turned a little, outlined, thick or in any common shade: ask the colour of a shape "
                  "or the shape of a colour in one picture or among several, 'Which shape moves?' about a video "
                  "(a short one, or one of a minute or more streamed under a KV cap, where 'What colour is the "
                  "triangle?' may ask about one in view for a few seconds), 'What is in the picture?' (every object, "
                  "colour and shape) or 'What colours are the circle and the ring?', in the message that sends the "
                  "media or a later one, and again about another shape in the same chat. Photos it mostly answers "
                  "'unknown'; drawings made otherwise less often (logos 82/100, line charts 80/100, street scenes "
                  "63/100: training/card_check.py), naming colours or shapes instead. It cannot read text or count.",
                  video_frames=drawn_scenes.SIZES["moving"][1][1], long_example=long_videos.example),
}


def of(directory: Path | None = None) -> Generation:
    """The generation of the weights in ``directory`` (default: the ones the app loads,
    :func:`~.arena_model.arena_dir`); a number this engine does not know is refused."""
    number = arena_model.bundled_version(directory)
    if number not in GENERATIONS:
        from ..errors import UserError

        raise UserError(f"{directory or arena_model.arena_dir()} holds tiny-arena-vl generation {number}; this app "
                        f"serves generations {', '.join(map(str, GENERATIONS))}. Unset KV_ARENA_TINY_DIR, or point "
                        "it at a run of training/train_arena.py or training/train_arena_v3.py.")
    return GENERATIONS[number]
