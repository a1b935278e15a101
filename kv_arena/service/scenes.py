"""The offline model's scenes with their true answers, so the app can mark each answer right or
wrong: the clickable examples (the scene generator's own, each with a follow-up about another
object of the same media, and the Chat tab's, :func:`arena_examples`) and fresh scenes drawn on request ("New scene"), one type at a time.
All of them are the served generation's (:mod:`kv_arena.tiny.generations`: the weights' config.json says which).

A scene is known by the content of its media files (:attr:`Prepared.media`), so Gradio's copies of
them are recognised, and it knows every object in its media (:mod:`.scene_truth`), so any question
about the colour or shape of one of them, or which moves, is marked, not only the two it was drawn
with; another question gets a short reason why it is not marked (:func:`judged`). An answer is right
when it equals the true one whole, case, spaces and punctuation aside. Media the app did not draw
(uploads, hub models' examples) get no mark.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import UserError
from ..media import write_avi
from ..tiny import generations
from .current import current_app
from .inputs import Prepared
from .model_picker import is_trained_here
from .scene_style import in_scene_style, message_pictures
from .scene_truth import SceneObject, judge, objects_of
from .uploads import ASSETS, cap_folders, file_hash, make_public, note_private, session_folder, trim_folder

KEEP = 256  # drawn scenes remembered for their answers
SCENES_PER_SESSION = 4  # a session's newest drawn scenes kept on disk (the one in the input box among them)


def max_scenes() -> int:
    """Drawn scenes kept on disk across sessions (``KV_ARENA_MAX_SCENES``), oldest out first."""
    return max(1, int(os.environ.get("KV_ARENA_MAX_SCENES", 64)))


LONG_EXAMPLE_CAP_MB = 1.0  # the long example's KV cap: a fraction of what its whole video takes


def arena_examples() -> list[tuple[str, list[str]]]:
    """The Chat tab's clickable examples for the trained model, one per question type of the served
    generation: (question, media files in assets/), each answered right."""
    return [(it.question.text, files) for it, files in generations.of().scenes.examples().values()]


@dataclass(frozen=True)
class LongExample:
    """The Chat tab's long video: its question, its file, and how it is sent (every drawn frame,
    streamed under a KV cap)."""

    question: str
    path: str
    frames: int
    seconds: float
    stream_cap_mb: float = LONG_EXAMPLE_CAP_MB


def long_example() -> LongExample | None:
    """The served generation's long-video example (None: it has none, or its file is not in assets/)."""
    return _long_example(generations.of())


@lru_cache(maxsize=None)
def _long_example(generation: generations.Generation) -> LongExample | None:
    scene = _long_scene(generation)
    if scene is None:
        return None
    item, _ = generation.long_example()
    return LongExample(scene.questions[0], scene.files[0], len(item.pictures), len(item.pictures) / item.fps)


@dataclass(frozen=True)
class Scene:
    """Media files and a conversation about them with its true answers (first question, follow-up),
    and every object its media show."""

    kind: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    files: tuple[str, ...]
    types: tuple[str, ...]  # the question types of the generation that drew it: what its objects answer
    objects: tuple[SceneObject, ...] = ()
    video: bool = False


def normalised(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def media_digest(files) -> str:
    """What :func:`kv_arena.service.inputs.prepare` calls the media's key: a hash of the files' contents."""
    digest = hashlib.sha1()
    for path in files:
        digest.update(file_hash(str(path)).encode())
    return digest.hexdigest()


class SceneBook:
    """The newest :data:`KEEP` drawn scenes, by the content key of their media."""

    def __init__(self) -> None:
        self.drawn: OrderedDict[str, Scene] = OrderedDict()
        self.lock = threading.Lock()

    def remember(self, media: str, scene: Scene) -> None:
        with self.lock:
            self.drawn[media] = scene
            while len(self.drawn) > KEEP:
                self.drawn.popitem(last=False)

    def find(self, media: str) -> Scene | None:
        with self.lock:
            return self.drawn.get(media)

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # the parent may have held it while forking


def _follow_up(item, objects: tuple[SceneObject, ...]) -> tuple[str, str] | None:
    """A colour question about an object the first question is not about (the generator's own
    follow-ups are of this kind); None when the scene has no other object."""
    first = normalised(f"{item.turns[0].text} {item.turns[0].answer}").split()
    other = next((o for o in objects if o.shape not in first and o.colour not in first), None)
    return None if other is None else (f"What colour is the {other.shape}?", other.colour)


def examples() -> tuple[Scene, ...]:
    """The served generation's clickable examples whose files assets/make_examples.py drew (in
    assets/), each with a follow-up (its generator's own, where its example has one)."""
    return _examples(generations.of())


@lru_cache(maxsize=None)
def _examples(generation: generations.Generation) -> tuple[Scene, ...]:
    out = []
    for kind, (item, files) in generation.scenes.examples().items():
        paths = tuple(str(ASSETS / f) for f in files)
        if not all(Path(p).is_file() for p in paths):
            continue
        objects = objects_of(item)
        turns = [(q.text, q.answer) for q in item.turns[:2]]
        if len(turns) == 1 and (extra := _follow_up(item, objects)):
            turns.append(extra)
        out.append(Scene(kind, tuple(q for q, _ in turns), tuple(a for _, a in turns), paths,
                         tuple(generation.scenes.QUESTION_TYPES), objects, item.video))
    return tuple(out)


@lru_cache(maxsize=None)
def _long_scene(generation: generations.Generation) -> Scene | None:
    """The long-video example as a scene (marked, not among Compare's examples: Compare does not stream)."""
    if generation.long_example is None:
        return None
    item, files = generation.long_example()
    path = ASSETS / files[0]
    if not path.is_file():
        return None
    return Scene("long", tuple(q.text for q in item.turns), tuple(q.answer for q in item.turns), (str(path),),
                 tuple(generation.scenes.QUESTION_TYPES), objects_of(item), True)


@lru_cache(maxsize=None)
def _example_digests(generation: generations.Generation) -> dict[str, Scene]:
    long = _long_scene(generation)
    return {media_digest(scene.files): scene for scene in _examples(generation) + ((long,) if long else ())}


def scene_types() -> tuple[str, ...]:
    """The question types "New scene" draws: the served generation's."""
    return tuple(generations.of().scenes.QUESTION_TYPES)


def draw_scene(kind: str, seed: int | None = None, owner: str = "anonymous", client: str | None = None) -> Scene:
    """A fresh scene of ``kind`` from the generator, with its first question and follow-up; its
    media are written in the folder of the session ``owner`` (its id) in Gradio's upload folder (a
    video as an uncompressed AVI, read back pixel for pixel), which keeps a session's newest
    :data:`SCENES_PER_SESSION` and :func:`max_scenes` in all, and goes with the session. Their URLs
    are served to the session's ``client`` only (to none without one); any session may use them in
    a message, as the examples."""
    scenes = generations.of().scenes
    kinds = tuple(scenes.QUESTION_TYPES)
    if not isinstance(kind, str) or kind not in kinds:
        raise UserError(f"The scene type must be one of {', '.join(kinds)}; got {str(kind)[:60]!r}.")
    item = scenes.fresh(kind, turns=2, seed=seed)
    mine = session_folder(owner, "scenes")
    folder = mine / uuid.uuid4().hex[:12]
    folder.mkdir()
    if item.video:
        paths = [folder / f"{kind}.avi"]
        write_avi(paths[0], item.frames(), fps=int(item.fps))
    else:
        paths = [folder / f"{kind}_{i}.png" for i in range(1, len(item.pictures) + 1)]
        for picture, path in zip(item.pictures, paths):
            picture.image().save(path)
    make_public([str(p) for p in paths])
    note_private([str(p) for p in paths], client)
    cap_folders(mine.parent, max_scenes())
    trim_folder(mine, SCENES_PER_SESSION)
    scene = Scene(kind, tuple(q.text for q in item.turns), tuple(q.answer for q in item.turns),
                  tuple(str(p) for p in paths), kinds, objects_of(item), item.video)
    current_app().scenes.remember(media_digest(paths), scene)
    return scene


def scene_of(media: str) -> Scene | None:
    """The drawn or example scene whose media have this content key (:attr:`Prepared.media`)."""
    if not media:
        return None
    return current_app().scenes.find(media) or _example_digests(generations.of()).get(media)


def judged(media: str, question: str) -> tuple[str | None, str]:
    """(true answer, "") for ``question`` about the scene with these media; (None, why it cannot be
    marked) for a question its objects do not answer; (None, "") when the media are no scene."""
    scene = scene_of(media)
    if scene is None:
        return None, ""
    asked = normalised(question)
    stored = next((a for q, a in zip(scene.questions, scene.answers) if normalised(q) == asked), None)
    return (stored, "") if stored is not None else judge(scene.objects, scene.video, question, scene.types)


def true_answer(media: str, question: str) -> str | None:
    """The true answer to ``question`` about the scene with these media, or None when unknown."""
    return judged(media, question)[0]


def is_right(answer: str, truth: str | None) -> bool | None:
    """Whole answer, normalised, against the true one; None when there is no true answer."""
    return None if truth is None else normalised(answer) == normalised(truth)


def media_hint(model: str, messages: list[Prepared]) -> str:
    """One sentence beside the answer when a model trained here gets what it was not made for: no
    media at all, or media that are not one of its scenes (an upload, a photo); what it reads is
    the model card's (the caller links it). A picture drawn in its scenes' style
    (:mod:`.scene_style`) is said to be its kind, its answers unmarked."""
    if not is_trained_here(model):
        return ""
    latest = next((p for p in reversed(messages) if p.media), None)
    if latest is None:
        return (f"Hint: {model} only answers questions about its kind of scenes, in a picture or a video (see the "
                "Examples); without one its answer means nothing.")
    if scene_of(latest.media) is not None:
        return ""
    # a picture a visitor drew in the scenes' style is the model's kind: said so, not turned away
    if in_scene_style(message_pictures(latest.message)):
        return (f"Note: drawn like {model}'s scenes, so it may read it; not marked right or wrong (only the "
                "Examples and New scene have known answers).")
    return f"Note: {model} reads only its own kind of scenes (drawn like its Examples), and this does not look like one."
