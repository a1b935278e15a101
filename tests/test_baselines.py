"""The baselines of issue 58 (random eviction, a smaller picture, video-token pruning) and loyalty: what
each keeps at a budget, that random repeats, EVS's first frame and rate, pictures through EVS, loyalty
on a tiny example, and the accuracy bench's guard on the committed figure."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.support import make_image, make_video

import backends
from backends.evs import PICTURES_ONLY, retained_count, retention_mask
from kv_arena.runtime.generate import Conversation, loyal
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.vision_tokens import config_refusal, refusal

QUESTION = "What is shown?"


def ask(loaded, backend, message: Message, tokens: int = 6):
    conv = Conversation(loaded, backend)
    return conv.ask(message, max_new_tokens=tokens, ignore_eos=True), conv


@pytest.mark.parametrize("method", ["random", "downsample", "evs"])
def test_at_budget_one_each_is_the_full_cache(models, method):
    loaded = models("tiny-qwen2.5-vl")
    message = Message(QUESTION, images=[make_image(0, (224, 224))], videos=[make_video(1, frames=4, size=112)])
    ref, _ = ask(loaded, backends.make_reference(), message)
    got, _ = ask(loaded, backends.make_backend(method, budget=1.0), message)
    assert got.token_ids == ref.token_ids and got.metrics.kv_bytes == ref.metrics.kv_bytes


# --- random ------------------------------------------------------------------------------------
def test_random_keeps_the_text_and_a_budgets_worth_of_visual_tokens(models):
    loaded = models("tiny-qwen2-vl")
    update, conv = ask(loaded, backends.make_backend("random", budget=0.3), Message(QUESTION, images=[make_image(0)]))
    layout, seen = conv.layouts[0], update.metrics.prompt_tokens
    visual = layout.visual_mask().nonzero().flatten() + layout.start
    text = torch.tensor([p for p in range(seen) if p not in set(visual.tolist())])
    for layer in conv.cache.layers:
        prompt = layer.positions[:, :-(update.metrics.new_tokens - 1) or None]  # decoded tokens are appended
        assert prompt.shape[1] == math.ceil(0.3 * seen)  # the budget: 0.3 of the full cache's entries
        assert all(torch.isin(text, head).all() for head in prompt)  # every text token, every head
    heads = conv.cache.layers[0].positions
    assert not torch.equal(heads[0], heads[1])  # a draw per KV head (kvpress's RandomPress)


def test_random_repeats_with_its_seed_and_draws_anew_with_another(models):
    loaded = models("tiny-qwen2-vl")
    message = Message(QUESTION, images=[make_image(0)])
    kept = [ask(loaded, backends.make_backend("random", budget=0.3, seed=seed), message)[1].cache.kept_positions()
            for seed in (0, 0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(kept[0], kept[1]))
    assert not all(torch.equal(a, b) for a, b in zip(kept[0], kept[2]))


def test_random_brings_a_follow_up_back_to_the_budget(models):
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("random", budget=0.3))
    conv.ask(Message(QUESTION, images=[make_image(0)]), max_new_tokens=3, ignore_eos=True)
    held_first = conv.cache.tokens_per_layer()[0]
    conv.ask(Message("Why?"), max_new_tokens=3, ignore_eos=True)
    held = conv.cache.tokens_per_layer()[0]
    assert held == math.ceil(0.3 * (conv.seen - 2)) + 2 < held_first + 20  # the budget of all seen, the answer appended


# --- downsample ----------------------------------------------------------------------------------
def test_downsample_sizes_a_picture_to_the_budgets_share_of_its_tokens(models):
    adapter = models("tiny-qwen2-vl").adapter
    assert adapter.scaled_size(448, 448, 0.25) == (224, 224)  # 256 tokens -> 64
    h, w = adapter.scaled_size(672, 868, 0.25)  # the processor reads 672 x 868 as 24 x 31 = 744 tokens
    assert h % 28 == 0 and w % 28 == 0 and (h // 28) * (w // 28) <= 0.25 * 744 and abs(w / h - 868 / 672) < 0.1
    assert adapter.scaled_size(448, 448, 1.0) == (448, 448)
    assert adapter.scaled_size(448, 448, 0.01) == (56, 56)  # never under the processor's min pixels (56 x 56)


def test_downsample_holds_the_smaller_prompt_whole(models):
    loaded = models("tiny-qwen2-vl")
    message = Message(QUESTION, images=[make_image(0)])  # 448 px: 256 visual tokens
    full, _ = ask(loaded, backends.make_reference(), message)
    small, conv = ask(loaded, backends.make_backend("downsample", budget=0.25), message)
    assert full.metrics.visual_tokens == 256 and small.metrics.visual_tokens == 64
    assert small.metrics.prompt_tokens == full.metrics.prompt_tokens - 192
    per_token = full.metrics.kv_bytes_prefill / full.metrics.prompt_tokens
    assert small.metrics.kv_bytes_prefill == per_token * small.metrics.prompt_tokens  # nothing evicted
    assert conv.layouts[0].images[0].grid == (1, 8, 8)


def test_downsample_is_refused_where_a_picture_always_makes_the_same_grid(models):
    loaded = models("tiny-llava")
    method = backends.make_backend("downsample", budget=0.5)
    assert "fixed grid" in refusal(loaded.model, method) and "fixed grid" in config_refusal(loaded.model.config, method)
    assert refusal(loaded.model, backends.make_backend("downsample", budget=1.0)) is None  # changes nothing: runs
    assert refusal(models("tiny-qwen3-vl").model, method) is None


# --- EVS -----------------------------------------------------------------------------------------
def test_evs_keeps_the_first_frame_and_the_most_changed_tokens_at_the_rate():
    torch.manual_seed(0)
    frames, per_frame, rate = 4, 6, 0.5
    embeds = torch.randn(1, per_frame, 8).repeat(frames, 1, 1)  # still...
    embeds[2, 1] = -embeds[1, 1]  # ...but for one token turning round in frame 2
    embeds[3, 4] = embeds[2, 4] + 0.3 * torch.randn(8)  # and one changing a little in frame 3
    mask = retention_mask(embeds, rate)
    assert mask[0].all()  # the first frame whole
    assert int(mask.sum()) == retained_count(per_frame, frames, rate) == 12  # int(4 x 6 x 0.5)
    assert mask[2, 1] and mask[3, 4]  # the changed ones first
    assert int(retention_mask(embeds, 0.99).sum()) == per_frame  # never below one frame
    assert retention_mask(embeds, 0.0).all()


def test_evs_scored_in_bfloat16_ties_still_places_and_keeps_the_earlier_frames():
    from tools.evs_dtype import compare, main, video

    still = video(frames=8, per_frame=32, width=256, noise=0.01, object_tokens=2, seed=0)
    exact = retention_mask(still, 0.75)
    rounded = retention_mask(still, 0.75, dtype=torch.bfloat16)
    assert int(exact.sum()) == int(rounded.sum()) == retained_count(32, 8, 0.75)
    # the grain's dissimilarities round to a few values and tie; the stable sort keeps frame 1's places
    assert rounded[1].sum() > exact[1].sum() and not torch.equal(exact, rounded)
    overlap, exact_frame, rounded_frame = compare(still, 0.75)
    assert 0 < overlap < 1 and rounded_frame < exact_frame
    assert main(["--frames", "4", "--per-frame", "16", "--width", "32", "--object", "2", "--seeds", "1"]) == 0
    assert main(["--rates", "1.5"]) == main(["--noise", "x"]) == 2


def test_evs_prunes_a_videos_tokens_at_the_rate_its_budget_sets(models):
    loaded = models("tiny-qwen2.5-vl")
    message = Message(QUESTION, videos=[make_video(0, frames=8, size=224)], num_frames=8)  # 4 frames of 64 tokens
    full, _ = ask(loaded, backends.make_reference(), message)
    update, conv = ask(loaded, backends.make_backend("evs", budget=0.5), message)
    report, video = conv.backend.report, conv.layouts[0].videos[0]
    frames, per_frame = video.grid[0], video.length // video.grid[0]
    assert frames == 4 and report.video_tokens == video.length
    assert report.kept_video_tokens == retained_count(per_frame, frames, report.pruning_rate) < video.length
    video_positions = torch.arange(*video.span)
    first_frame = torch.arange(*video.frames[0])
    for layer in conv.cache.layers:  # every layer holds the same tokens: the pruned ones never entered
        held = layer.positions[0]
        assert torch.isin(first_frame, held).all()
        assert int(torch.isin(held, video_positions).sum()) == report.kept_video_tokens
    assert conv.cache.tokens_per_layer()[0] - 5 == full.metrics.prompt_tokens - video.length + report.kept_video_tokens
    assert 0 < report.pruning_rate < 1  # the budget is reachable: the cache holds it (to a token)
    assert update.metrics.kv_bytes_prefill / full.metrics.kv_bytes_prefill == pytest.approx(0.5, abs=0.01)
    assert report.note is None


def test_evs_passes_pictures_through_and_says_so(models):
    loaded = models("tiny-qwen2.5-vl")
    message = Message(QUESTION, images=[make_image(0, (224, 224))])
    ref, _ = ask(loaded, backends.make_reference(), message)
    got, conv = ask(loaded, backends.make_backend("evs", budget=0.2), message)
    assert got.token_ids == ref.token_ids and got.metrics.kv_bytes == ref.metrics.kv_bytes
    assert conv.backend.report.note == PICTURES_ONLY and "whole cache" in PICTURES_ONLY
    conv.ask(Message("And then?"), max_new_tokens=2)
    assert conv.backend.report.note is None  # a text turn has nothing to say


# --- loyalty -------------------------------------------------------------------------------------
def test_loyalty_is_the_share_of_whole_answers_equal_to_the_full_caches():
    from kv_arena.bench.accuracy import Verdict, judge, scored

    assert loyal("Purple.", "purple") and not loyal("purple circle", "purple")
    reference = {"with": ["red", "blue square", "green"], "before": ["red", "blue", "green"],
                 "follow": ["one", "two", "three"]}
    said = {"with": ["Red!", "blue square", "green green"], "before": ["x", "y", "z"], "follow": ["one", "two", "three"]}
    verdicts = {k: [judge(text, "red") for text in texts] for k, texts in said.items()}
    point = scored(verdicts, [5, 5, 5], [10, 10, 10], reference)
    assert point["with_loyalty"] == pytest.approx(2 / 3) and point["before_loyalty"] == 0
    assert point["follow_loyalty"] == 1 and point["with"] == pytest.approx(1 / 3) and point["realised"] == 0.5
    assert scored(verdicts, [5] * 3, [10] * 3)["before_loyalty"] == 1  # the full cache: loyal by definition
    assert Verdict(1.0, False).said == ""


def test_the_accuracy_tables_carry_loyalty_per_protocol():
    from kv_arena.bench.accuracy import markdown, table

    row = {"n": 4, "realised": 0.25, "with": 0.5, "before": 0.25, "follow": 0.75, "with_ran_on": 0.0,
           "before_ran_on": 0.0, "follow_ran_on": 0.0, "with_loyalty": 0.75, "before_loyalty": 0.5,
           "follow_loyalty": 1.0}
    old = {k: v for k, v in row.items() if not k.endswith("_loyalty")}  # a row measured before loyalty was
    report = {"model": "m", "per_type": 4, "generation": 3, "probe": {},
              "points": {"colour": {"random": [{"knob": "budget", "value": 0.25} | row],
                                    "snapkv": [{"knob": "budget", "value": 0.25} | old]}}}
    lines = markdown(report).splitlines()
    assert "loyalty (with / before / follow)" in lines[0]
    assert "| 0.75 / 0.50 / 1.00 |" in lines[2] and "| - |" in lines[3]
    assert "loyalty 0.75/0.50/1.00" in table(report) and "loyalty -/-/-" in table(report)


def test_random_eviction_over_several_seeds_is_their_mean_with_each_draw_beside_it():
    """Random eviction draws one mask per prompt shape: ``--seeds`` averages several draws and keeps
    each draw's rate, so the table shows their spread (issue #70)."""
    from kv_arena.bench.accuracy import averaged, line

    draws = [{"n": 34, "realised": 0.2, "with": w, "before": b, "follow": f, "with_ran_on": 0.0, "before_ran_on": 0.0,
              "follow_ran_on": 0.0, "with_loyalty": w, "before_loyalty": b, "follow_loyalty": f}
             for w, b, f in [(1.0, 0.5, 0.25), (1.0, 0.25, 0.75), (0.5, 0.75, 0.5)]]
    point = averaged(draws)
    assert point["n"] == 34 and point["seeds"] == 3 and point["before"] == pytest.approx(0.5)
    assert point["before_seeds"] == [0.5, 0.25, 0.75] and point["realised"] == pytest.approx(0.2)
    shown = line("colour", "random", {"knob": "budget", "value": 0.2} | point)
    assert "over 3 seeds: with 0.50-1.00  before 0.25-0.75  follow 0.25-0.75" in shown


def test_compare_shows_each_methods_loyalty():
    from components import compare
    from kv_arena import service

    meters = service.Meters(prompt_tokens=10, kv_bytes_prefill=100)
    full = service.CompareRun("full", "Full cache", (
        service.CompareTurn("q1", "red", meters, agreement=1.0, loyal=True, done=True),
        service.CompareTurn("q2", "a square", meters, agreement=1.0, loyal=True, done=True)), done=True)
    method = service.CompareRun("random", "Random eviction", (
        service.CompareTurn("q1", "Red.", service.Meters(prompt_tokens=10, kv_bytes_prefill=25), agreement=1.0,
                            loyal=True, done=True),
        service.CompareTurn("q2", "a circle", service.Meters(prompt_tokens=10, kv_bytes_prefill=25), agreement=0.5,
                            loyal=False, done=True, note="a method's note")), done=True)
    rows = compare.table((full, method))
    assert compare.COLUMNS[-1] == "Loyal to full" and len(compare.WIDTHS) == len(compare.COLUMNS)
    assert [row[-1] for row in rows] == ["", "", "✓", "✗"] and rows[3][8] == "50%"
    text = compare.answer_text(method, full)
    assert text.startswith("holds 0.25x the full KV\na method's note\n\n") and text.endswith("loyalty 1/2: answers "
                                                                                          "that are the full cache's, whole")


# --- the committed figure ------------------------------------------------------------------------
def test_a_run_naming_dataset_or_out_never_writes_over_the_committed_figure(tmp_path, capsys):
    from kv_arena.bench import accuracy, cli
    from kv_arena.paths import ASSETS

    committed = ASSETS / "accuracy"
    args = accuracy.parse_args(["--dataset", "lmms-lab/DocVQA", "--metric", "anls"])
    assert args.out == str(ASSETS.parent / "runs" / "accuracy-lmms-lab-DocVQA")
    assert accuracy.parse_args(["--from-json", str(tmp_path / "r.json")]).out == str(tmp_path / "r")
    assert accuracy.parse_args([]).out == str(committed)  # the committed run: named by neither
    accuracy.check_out(accuracy.parse_args([]))
    before = {s: (committed.with_suffix(s).stat().st_mtime_ns if committed.with_suffix(s).exists() else None)
              for s in (".json", ".html", ".png")}
    for argv in (["--out", str(committed)], ["--out", "assets/../assets/accuracy"],
                 ["--dataset", str(tmp_path), "--metric", "vqa", "--out", str(committed)]):
        with pytest.raises(accuracy.UserError, match="committed figure"):
            accuracy.check_out(accuracy.parse_args(argv))
        assert cli.main(["--mode", "accuracy", *argv, "--per-type", "1", "--no-probe"]) == 2
        assert "committed figure" in capsys.readouterr().err
    assert before == {s: (committed.with_suffix(s).stat().st_mtime_ns if committed.with_suffix(s).exists() else None)
                      for s in (".json", ".html", ".png")}
    earlier = {"model": "m", "per_type": 1, "generation": 3, "probe": {}, "points": {}}
    (tmp_path / "e.json").write_text(json.dumps(earlier))
    accuracy.check_out(accuracy.parse_args(["--from-json", str(tmp_path / "e.json"), "--out", str(tmp_path / "x")]))


def test_chat_and_compare_say_that_evs_held_a_picture_whole(media):
    """EVS on a picture holds the whole cache: Chat's note and Compare's answer column say why, so
    its 1.00x is not read as a result."""
    from components import compare
    from kv_arena import service
    from tests.app_support import ask as message, config, turn

    outputs, error = turn(service.Session(), message("What is this?", media["image"]), method="evs", budget=0.2)
    assert error is None
    realised = [o.realised for o in outputs if isinstance(o.realised, str)][-1]
    assert "1.00x" in realised and PICTURES_ONLY in realised
    last = list(compare.respond(message("What is this?", media["image"]), ["evs", "random"], service.Session(),
                                config(max_new_tokens=3, budget=0.2)))[-1]
    evs, rand = last.answers[1], last.answers[2]
    assert evs.startswith("holds 1.00x the full KV\n" + PICTURES_ONLY) and PICTURES_ONLY not in rand
    assert "loyalty " in evs and last.table[1][-1] in ("✓", "✗")
