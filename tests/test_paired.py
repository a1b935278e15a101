"""The paired test of two methods over the same chats: exact McNemar against hand-worked binomial
tails, the per-chat verdicts an accuracy run records, and ``--paired``'s lines and refusals."""

from __future__ import annotations

import json

import pytest

from kv_arena.bench import cli
from kv_arena.bench.paired import McNemar, Side, compare, expand, mcnemar, parse_pair
from kv_arena.errors import UserError


def pairs(a_only: int, b_only: int, both: int = 0, neither: int = 0) -> tuple[list[bool], list[bool]]:
    a = [True] * a_only + [False] * b_only + [True] * both + [False] * neither
    b = [False] * a_only + [True] * b_only + [True] * both + [False] * neither
    return a, b


def test_mcnemar_is_the_exact_two_sided_binomial_tail_of_the_discordant_chats():
    assert mcnemar(*pairs(0, 10)) == McNemar(10, 0, 2 * 0.5**10)  # the most uneven split of 10, either way
    assert mcnemar(*pairs(10, 0)) == McNemar(0, 10, 2 * 0.5**10)
    assert mcnemar(*pairs(1, 4)).p_value == 12 / 32  # 2 * (C(5,0) + C(5,1)) / 2**5
    assert mcnemar(*pairs(8, 2)).p_value == 112 / 1024  # 2 * (1 + 10 + 45) / 2**10
    assert mcnemar(*pairs(0, 5)).p_value == 2 / 32 and mcnemar(*pairs(0, 6)).p_value == 2 / 64  # 6-0 is the least at 0.05
    assert mcnemar(*pairs(5, 5, both=40)).p_value == 1.0  # symmetric: capped at 1
    assert mcnemar(*pairs(0, 1)).p_value == 1.0
    assert mcnemar(*pairs(0, 0, both=7, neither=3)) == McNemar(0, 0, 1.0)  # agreeing chats say nothing
    assert mcnemar([], []) == McNemar(0, 0, 1.0)
    assert mcnemar(*pairs(0, 60)).p_value == 2 * 0.5**60  # exact in integers, no underflow at this size
    with pytest.raises(ValueError, match="same chats"):
        mcnemar([True], [True, False])


def test_paired_names_are_method_or_method_at_value_and_anything_else_is_refused():
    assert parse_pair("snapkv+fp8@0.4, snapkv@0.2") == (Side("snapkv+fp8", 0.4), Side("snapkv", 0.2))
    assert parse_pair("int4,full") == (Side("int4", None), Side("full", None))
    assert str(Side("snapkv", 0.2)) == "snapkv@0.2"
    assert parse_pair("all,random") == (Side("all", None), Side("random", None))
    for bad in ("snapkv", "a,b,c", "snapkv@x,full", "full,full", ",full", "random,all", "all@0.2,random"):
        with pytest.raises(UserError, match="--paired"):
            parse_pair(bad)


def run_of(rights: dict[str, dict[str, list[bool]]]) -> dict:
    """A run's JSON with each point's per-chat verdicts (one type, 'colour'; every protocol the same)."""
    points = {}
    for name, right in rights.items():
        method, _, value = name.partition("@")
        per_chat = {f"colour/{i}": r for i, r in enumerate(right["with"])}
        points.setdefault(method, []).append({"knob": "budget" if value else None, "value": float(value) if value else None,
                                              "right": {p: per_chat for p in ("with", "before", "follow")}})
    return {"points": {"colour": points}}


def test_compare_prints_counts_p_and_the_verdict_per_column_with_the_test_named():
    report = run_of({"full": {"with": [True] * 12}, "snapkv@0.2": {"with": [False] * 6 + [True] * 6},
                     "snapkv@0.4": {"with": [False] * 5 + [True] * 7}})
    lines = compare(report, Side("full", None), Side("snapkv", 0.2))
    assert len(lines) == 3
    assert lines[0] == ("full vs snapkv@0.2, with the question: right only under full 6, only under snapkv@0.2 0, "
                        "p = 0.0312 (exact McNemar over the same 12 chats): full beats snapkv@0.2")
    assert lines[2].startswith("full vs snapkv@0.2, follow-up:")
    assert compare(report, Side("snapkv", 0.4), Side("full", None))[1].endswith("p = 0.0625 (exact McNemar over the "
                                                                                  "same 12 chats): ties")
    with pytest.raises(UserError, match="snapkv names more than one point of this run; it has snapkv@0.2, snapkv@0.4"):
        compare(report, Side("snapkv", None), Side("full", None))
    with pytest.raises(UserError, match="h2o is not in this run"):
        compare(report, Side("h2o", None), Side("full", None))
    report["points"]["colour"]["snapkv"][1]["right"]["with"]["colour/0"] = 0.67  # a data set's metric, between
    with pytest.raises(UserError, match="paired test unavailable: it counts right and wrong answers"):
        compare(report, Side("snapkv", 0.4), Side("full", None))
    del report["points"]["colour"]["full"][0]["right"]  # a run written before the verdicts were kept
    with pytest.raises(UserError, match="paired test unavailable: full has no per-chat verdicts"):
        compare(report, Side("full", None), Side("snapkv", 0.2))


def test_a_point_drawn_with_several_seeds_is_tested_once_per_draw():
    """Random eviction under --seeds: each draw keeps its verdicts, and the test runs per draw."""
    from kv_arena.bench.accuracy import averaged

    def draw(wrong: int) -> dict:
        per_chat = {f"colour/{i}": i >= wrong for i in range(12)}
        return {"n": 12, "realised": 0.2, "right": {p: per_chat for p in ("with", "before", "follow")}} | {
            p: (12 - wrong) / 12 for p in ("with", "before", "follow")}

    point = averaged([draw(6), draw(1), draw(0)])
    assert point["seeds"] == 3 and [d["with"]["colour/0"] for d in point["right_seeds"]] == [False, False, True]
    report = run_of({"full": {"with": [True] * 12}})
    report["points"]["colour"]["random"] = [{"knob": "budget", "value": 0.2} | point]
    lines = compare(report, Side("full", None), Side("random", None))
    assert lines[0] == ("full vs random, with the question: right only under full 0 to 6, only under random 0, "
                        "p = 0.0312 to 1 (exact McNemar over the same 12 chats, once per draw): ties in 2 of 3 "
                        "draws, full beats random in 1 of 3 draws")
    del report["points"]["colour"]["random"][0]["right_seeds"]  # a run from before the draws kept theirs
    with pytest.raises(UserError, match="random has no per-chat verdicts \\(averaged over seeds"):
        compare(report, Side("full", None), Side("random", None))


def test_all_pairs_each_other_point_of_the_run_with_b_once_per_value():
    report = run_of({"full": {"with": [True] * 4}, "snapkv@0.2": {"with": [True] * 4},
                     "snapkv@0.4": {"with": [True] * 4}, "random@0.2": {"with": [False] * 4}})
    assert expand(report, Side("all", None), Side("random", None)) == [
        (Side("full", None), Side("random", None)), (Side("snapkv", 0.2), Side("random", None)),
        (Side("snapkv", 0.4), Side("random", None))]
    assert expand(report, Side("all", None), Side("snapkv", 0.2)) == [
        (Side("full", None), Side("snapkv", 0.2)), (Side("snapkv", 0.4), Side("snapkv", 0.2)),
        (Side("random", None), Side("snapkv", 0.2))]
    # B named with its value: its own point is still left out
    assert [a for a, _ in expand(report, Side("all", None), Side("random", 0.2))] == [
        Side("full", None), Side("snapkv", 0.2), Side("snapkv", 0.4)]
    assert expand(report, Side("full", None), Side("random", None)) == [(Side("full", None), Side("random", None))]
    with pytest.raises(UserError, match="h2o is not in this run"):
        expand(report, Side("all", None), Side("h2o", None))


def test_an_accuracy_run_keeps_each_chats_verdicts_and_paired_reads_them_back(tmp_path, capsys):
    """A tiny run records every chat's verdict per protocol under a stable id; --paired on its JSON
    prints one line per column; a bad pair name is refused in one line, before any run."""
    out = tmp_path / "acc"
    assert cli.main(["--mode", "accuracy", "--methods", "full,snapkv", "--budgets", "0.2", "--types", "colour,shape",
                     "--per-type", "1", "--no-probe", "--no-figure", "--out", str(out), "--paired", "full,snapkv"]) == 0
    printed = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "acc.json").read_text())
    for kind in ("colour", "shape"):
        for method in ("full", "snapkv"):
            point = report["points"][kind][method][0]
            assert set(point["right"]) == {"with", "before", "follow"}
            for protocol, verdicts in point["right"].items():
                assert list(verdicts) == [f"{kind}/0"]
                assert point[protocol] == float(verdicts[f"{kind}/0"])  # one chat: the rate is its verdict
    paired = [s for s in printed if s.startswith("full vs snapkv, ")]
    assert len(paired) == 3 and all("(exact McNemar over the same 2 chats): " in s for s in paired)
    assert cli.main(["--mode", "accuracy", "--from-json", str(tmp_path / "acc.json"), "--no-figure",
                     "--paired", "snapkv@0.2,full"]) == 0
    again = [s for s in capsys.readouterr().out.splitlines() if s.startswith("snapkv@0.2 vs full, ")]
    assert len(again) == 3
    assert cli.main(["--mode", "accuracy", "--methods", "full,snapkv", "--per-type", "1", "--no-probe", "--no-figure",
                     "--out", str(tmp_path / "b"), "--paired", "snapkv,h2o"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --paired: h2o is not among the methods run (full, snapkv)\n"
    for pair, said in [("snapkv@0.4,full", "snapkv@0.4 names no point of this run; it will have snapkv@0.2"),
                       ("snapkv,full", "snapkv names more than one point of this run; it will have snapkv@0.1, "
                                       "snapkv@0.2, snapkv@0.5")]:  # a wrong value: refused before the run
        budgets = "0.2" if "@" in pair else "0.1,0.2,0.5"
        assert cli.main(["--mode", "accuracy", "--methods", "snapkv", "--budgets", budgets, "--per-type", "1",
                         "--no-probe", "--no-figure", "--out", str(tmp_path / "c"), "--paired", pair]) == 2
        assert capsys.readouterr().err == f"error: --paired: {said}\n"
    assert not (tmp_path / "c.json").exists()
    assert not (tmp_path / "b.json").exists()


def test_the_committed_table_keeps_each_chats_verdict_and_its_docs_verdicts_are_the_pairs():
    from kv_arena.paths import ASSETS

    report = json.loads((ASSETS / "accuracy.json").read_text())
    assert all("right" in p for per in report["points"].values() for rows in per.values() for p in rows)

    def verdicts(pair: str) -> list[str]:  # with, before, follow-up: "A beats B" or "ties"
        return [line.rsplit(": ", 1)[1] for line in compare(report, *parse_pair(pair))]

    # docs/benchmarks.md's "Against the baselines": the four that interval overlap had called ties
    assert verdicts("snapkv,downsample")[2] == "snapkv beats downsample"
    assert verdicts("adakv,downsample")[2] == "adakv beats downsample"
    assert verdicts("h2o,random")[1] == "h2o beats random"
    assert verdicts("fastv,random") == ["ties", "fastv beats random", "fastv beats random"]
    assert verdicts("pyramidkv,random") == ["pyramidkv beats random", "ties", "pyramidkv beats random"]
    assert verdicts("elastic_cache,random") == ["random beats elastic_cache"] * 3
    every = [line for a, b in expand(report, *parse_pair("all,random")) for line in compare(report, a, b)]
    assert len(every) == 3 * 17  # the full cache, 15 methods and KIVI at 2 and 4 bits, each column
