"""The accuracy bench on public data sets: the metrics against hand-worked cases, the schemas read
from folders written here with ``datasets`` (nothing is downloaded), and the offline model scored."""

import json

import pytest

from kv_arena.bench import cli
from kv_arena.bench.metrics import anls, choice_accuracy, option_letter, relaxed_accuracy, score, vqa_accuracy

datasets = pytest.importorskip("datasets")


# --- metrics, from their definitions ------------------------------------------------------------
def test_anls_is_one_minus_the_normalised_distance_below_the_threshold():
    assert anls(" Stop ", ["stop"]) == 1.0  # case and outer spaces ignored
    assert anls("1O May", ["10 May"]) == pytest.approx(1 - 1 / 6)  # one substitution in six characters
    assert anls("hello wrld", ["hello world"]) == pytest.approx(1 - 1 / 11)  # one deletion in eleven
    assert anls("abcd", ["abxy"]) == 0.0  # NL = 2/4 = 0.5: not below the threshold
    assert anls("abcde", ["abxye"]) == pytest.approx(0.6)  # NL = 2/5
    assert anls("paris", ["london", "Paris"]) == 1.0  # the best accepted answer counts
    assert anls("", [""]) == 1.0


def test_vqa_accuracy_is_a_third_per_human_up_to_one():
    humans = ["2", "2", "two", "3", "3", "4", "2 ", "many", "3", "3"]
    assert vqa_accuracy("Two", humans) == 1.0  # four humans said 2 once normalised: min(4/3, 1)
    assert vqa_accuracy("4", humans) == pytest.approx(1 / 3)
    assert vqa_accuracy("3.", humans) == 1.0  # four said 3; the full stop is punctuation
    assert vqa_accuracy("five", humans) == 0.0
    assert vqa_accuracy("the dog", ["dog", "a dog"]) == pytest.approx(2 / 3)  # articles dropped
    assert vqa_accuracy("2.5", ["2.5", "2.5", "2.5"]) == 1.0  # a decimal point is no punctuation


def test_relaxed_accuracy_allows_five_percent_on_numbers_only():
    assert relaxed_accuracy("10.4", ["10"]) == 1.0 and relaxed_accuracy("10.5", ["10"]) == 1.0
    assert relaxed_accuracy("10.6", ["10"]) == 0.0
    assert relaxed_accuracy("1,050", ["1000"]) == 1.0  # thousands separators read as a number
    assert relaxed_accuracy("45%", ["0.45"]) == 1.0  # a percentage, as ChartQA's evaluator reads it
    assert relaxed_accuracy("0", ["0"]) == 1.0 and relaxed_accuracy("0.01", ["0"]) == 0.0
    assert relaxed_accuracy("Yes", ["yes"]) == 1.0 and relaxed_accuracy("Yess", ["yes"]) == 0.0  # text: exact


def test_choice_takes_the_option_letter_the_answer_gives():
    options = ["cat", "dog", "bird"]
    for said in ("B", "(B)", "B. dog", "b", "The answer is B", "Answer: B", "dog"):
        assert option_letter(said, options) == "B", said
    for said in ("D", "a cat sat", "I do not know"):  # no such option, a word, nothing
        assert option_letter(said, options) is None, said
    assert choice_accuracy("B", options, "B") == 1.0 and choice_accuracy("C", options, "B") == 0.0
    assert score("choice", "(A)", ["A"], options) == 1.0
    with pytest.raises(ValueError):
        score("bleu", "a", ["a"])


# --- data sets saved with datasets ----------------------------------------------------------------
def single_picture_scenes(count: int) -> list:
    """The offline model's example scenes of one picture (the served generation's), then held-out ones,
    with their true answers."""
    from kv_arena.tiny import generations

    scenes = generations.of().scenes
    items = [it for it, _ in scenes.examples().values() if not it.video and len(it.pictures) == 1]
    items += [it for it in scenes.held_out("shape", 4 * count) if len(it.pictures) == 1]
    return items[:count]


def test_a_saved_folder_scores_the_offline_model_and_the_full_cache_answers_right(tmp_path, capsys):
    items = single_picture_scenes(4)
    datasets.Dataset.from_dict({"image": [it.pictures[0].image() for it in items],
                                "question": [it.question.text for it in items],
                                "answers": [[it.question.answer, "unused"] for it in items]}).save_to_disk(tmp_path / "vqa")
    code = cli.main(["--mode", "accuracy", "--dataset", str(tmp_path / "vqa"), "--metric", "anls", "--methods",
                     "full,snapkv", "--budgets", "0.5", "--limit", "3", "--no-figure", "--out", str(tmp_path / "acc"), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["dataset"] == str(tmp_path / "vqa") and report["metric"] == "anls" and report["per_type"] == 3
    (points,) = report["points"].values()
    (full,) = points["full"]
    assert full["n"] == 3 and full["realised"] == 1.0 and full["with"] == 1.0 and full["before"] == 1.0
    (snap,) = points["snapkv"]
    assert snap["value"] == 0.5 and 0 < snap["realised"] <= 0.55 and {"with", "before", "follow"} <= snap.keys()
    assert report["probe"] == {}  # the probes need the scenes' object tokens
    assert json.loads((tmp_path / "acc.json").read_text()) == report


def test_multiple_choice_schemas_list_the_options_and_take_the_key(tmp_path):
    from kv_arena.bench.datasets_items import CHOICE_PROMPT, load_items
    from kv_arena.media import write_avi
    from tests.support import make_image, make_video

    datasets.Dataset.from_dict({  # Video-MME: options written "A. text", the video by a path inside the folder
        "video": ["clip.avi"], "question": ["What moves?"], "options": [["A. a cat", "B. a dog"]], "answer": ["B"],
    }).save_to_disk(tmp_path / "videomme")
    write_avi(tmp_path / "videomme" / "clip.avi", make_video(0, frames=4, size=56).frames)
    (video,) = load_items(str(tmp_path / "videomme"), "choice", num_frames=4)
    assert video.question.text == f"What moves?\nA. a cat\nB. a dog\n{CHOICE_PROMPT}"
    assert video.question.answers == ("B",) and len(video.media()["videos"]) == 1 and not video.media()["images"]
    assert video.question.score("B") == 1.0 and video.question.score("a cat") == 0.0
    datasets.DatasetDict({"dev": datasets.Dataset.from_dict({  # MMBench: a column per option, empty past the last
        "image": [make_image(0)], "question": ["Which colour?"], "A": ["red"], "B": ["blue"], "C": [""], "answer": ["A"],
    })}).save_to_disk(tmp_path / "mmbench")
    (mm,) = load_items(str(tmp_path / "mmbench"), "choice", split="dev")
    assert mm.question.options == ("red", "blue") and mm.question.score("red") == 1.0 and len(mm.images) == 1


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "DATA"], "--dataset needs --metric"),
    (["--metric", "anls"], "go with --dataset"),
    (["--dataset", "DATA", "--metric", "anls", "--limit", "0"], "--limit must be at least 1"),
    (["--dataset", "DATA", "--metric", "choice"], "needs options"),
    (["--dataset", "DATA", "--metric", "anls", "--split", "train"], "choose one with --split"),
    (["--dataset", "./nowhere", "--metric", "anls"], "no data set folder"),
])
def test_bad_data_set_input_is_one_line(tmp_path, capsys, argv, message):
    from tests.support import make_image

    datasets.DatasetDict({"test": datasets.Dataset.from_dict(
        {"image": [make_image(0)], "question": ["What is it?"], "answers": [["a square"]]})}).save_to_disk(tmp_path / "d")
    argv = [str(tmp_path / "d") if a == "DATA" else a for a in argv]
    capsys.readouterr()  # the saving's progress bar
    assert cli.main(["--mode", "accuracy", *argv, "--no-figure", "--out", str(tmp_path / "acc")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_without_datasets_installed_the_bench_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    (tmp_path / "d").mkdir()
    assert cli.main(["--mode", "accuracy", "--dataset", str(tmp_path / "d"), "--metric", "vqa", "--no-figure"]) == 2
    assert "pip install datasets" in capsys.readouterr().err
