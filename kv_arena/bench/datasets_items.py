"""Items of a public VQA data set, read with Hugging Face ``datasets`` (a dev requirement, imported
here only: the library never needs it), as the accuracy bench asks them.

Schemas read: DocVQA / TextVQA / VQAv2 (``image``, ``question``, ``answers``: a list, or a string),
ChartQA (``image``, ``query`` or ``question``, ``label`` or ``answer``), multiple choice such as
MMBench and Video-MME (``question``, ``options``: a list or letter -> text, or MMBench's columns ``A``,
``B``, ...; ``answer``: the key letter, or its index). Media: ``image`` (one or a list; PIL, bytes or a
path) or ``video`` / ``video_path`` (a path; relative to a local data set's folder).

A source is a folder written by ``Dataset.save_to_disk`` (a ``DatasetDict`` picks ``--split``), or a
hub id, streamed, so ``--limit 200`` reads 200 items and no more.
"""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .metrics import LETTERS, METRICS, score

CHOICE_PROMPT = "Answer with the option's letter from the given choices directly."
FOLLOW_OPENER = "Describe the picture in a few words."  # the first turn of the follow-up protocol


@dataclass(frozen=True)
class DatasetQuestion:
    """One question with its accepted answers, scored by ``metric`` (``answer``: the longest accepted
    answer, which sizes the token budget of the reply)."""

    text: str
    answers: tuple[str, ...]
    metric: str
    options: tuple[str, ...] = ()

    @property
    def answer(self) -> str:
        return max(self.answers, key=len)

    def score(self, text: str) -> float:
        return score(self.metric, text, list(self.answers), list(self.options))


@dataclass
class DatasetItem:
    """One row: its question (``turns``: the question alone) and media; ``follow_turns`` asks it
    after an opener turn, so the cache was compressed seeing another prompt."""

    question: DatasetQuestion
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    num_frames: int = 8

    @property
    def turns(self) -> list:
        return [self.question]

    @property
    def follow_turns(self) -> list:
        return [DatasetQuestion(FOLLOW_OPENER, ("",), "anls"), self.question]

    def media(self) -> dict:
        return {"images": self.images, "videos": self.videos, "num_frames": self.num_frames}


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError("--dataset needs Hugging Face datasets: pip install datasets") from None
    return datasets


def open_rows(source: str, split: str | None = None, subset: str | None = None):
    """The rows of ``source`` (a ``save_to_disk`` folder, or a hub id streamed) and the folder
    relative media paths are read from (None for the hub)."""
    datasets = _datasets()
    folder = Path(source)
    if folder.is_dir():
        data = datasets.load_from_disk(str(folder))
        if isinstance(data, datasets.DatasetDict):
            if split is None and len(data) == 1:
                split = next(iter(data))
            if split not in data:
                raise UserError(f"{source} has the splits {', '.join(data)}: choose one with --split")
            data = data[split]
        return data, folder
    if source.startswith((".", "/")) or source.count("/") > 1:
        raise UserError(f"no data set folder at {source}")
    try:
        return datasets.load_dataset(source, subset, split=split or "test", streaming=True), None
    except Exception as exc:  # noqa: BLE001 - the hub's errors are many; one line says which source failed
        raise UserError(f"could not open the data set '{source}': {str(exc).splitlines()[0]}") from None


def _image(value, folder: Path | None):
    from PIL import Image

    from ..media import load_image

    if isinstance(value, dict):  # an undecoded Image feature
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes):
        value = Image.open(io.BytesIO(value))
    elif isinstance(value, str) and folder is not None and not Path(value).is_absolute():
        value = folder / value
    return load_image(value)


def _options(row: dict) -> tuple[str, ...]:
    options = row.get("options")
    if options is None:  # MMBench: one column per letter, empty past the last option
        options = [row[k] for k in LETTERS if k in row and row[k] not in (None, "") and str(row[k]) != "nan"]
    elif isinstance(options, dict):
        options = [options[k] for k in sorted(options)]
    # "A. cat" as Video-MME writes them: the letter is ours to add
    return tuple(o[3:] if len(o) > 2 and o[0] in LETTERS and o[1:3] == ". " else str(o) for o in map(str, options))


def _answers(row: dict, metric: str, options: tuple[str, ...]) -> tuple[str, ...]:
    value = next((row[k] for k in ("answers", "answer", "label") if row.get(k) not in (None, "", [])), None)
    if value is None:
        raise UserError(f"a row has no answers, answer or label: its columns are {', '.join(row)}")
    if metric == "choice":
        key = LETTERS[value] if isinstance(value, int) else str(value).strip()
        if key not in LETTERS[: len(options)]:
            key = next((LETTERS[i] for i, o in enumerate(options) if o == key), key)  # the answer given as its text
        return (key,)
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else (str(value),)


def item_of(row: dict, metric: str, folder: Path | None = None, num_frames: int = 8) -> DatasetItem:
    """One row as an item: the prompt (a multiple-choice one lists the lettered options), its
    answers and its media."""
    text = row.get("question") or row.get("query")
    if not text:
        raise UserError(f"a row has no question or query: its columns are {', '.join(row)}")
    options = _options(row) if metric == "choice" else ()
    if metric == "choice":
        if not options:
            raise UserError("--metric choice needs options: an 'options' column or columns A, B, ...")
        text = "\n".join([text, *(f"{LETTERS[i]}. {o}" for i, o in enumerate(options)), CHOICE_PROMPT])
    question = DatasetQuestion(str(text), _answers(row, metric, options), metric, options)
    images = row.get("image") if row.get("image") is not None else row.get("images") or []
    images = [_image(v, folder) for v in (images if isinstance(images, list) else [images])]
    video = row.get("video") or row.get("video_path")
    videos = []
    if video:
        from ..media import load_video

        path = Path(video) if folder is None or Path(video).is_absolute() else folder / video
        videos = [load_video(str(path), num_frames)]
    if not images and not videos:
        raise UserError(f"a row has no image or video: its columns are {', '.join(row)}")
    return DatasetItem(question, images, videos, num_frames)


def load_items(source: str, metric: str, split: str | None = None, limit: int | None = None,
               subset: str | None = None, num_frames: int = 8) -> list[DatasetItem]:
    """The first ``limit`` rows of ``source`` as items (all of them without a limit)."""
    if metric not in METRICS:
        raise UserError(f"unknown --metric '{metric}'; choose from: {', '.join(METRICS)}")
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be at least 1; got {limit}")
    rows, folder = open_rows(source, split, subset)
    items = [item_of(dict(row), metric, folder, num_frames) for row in itertools.islice(rows, limit)]
    if not items:
        raise UserError(f"the data set '{source}' has no rows")
    return items
