"""The "Can you tell?" tab through its API (``/blind``, ``/vote``, ``/leaderboard``) on a real
``python app.py`` with the default SQLite file in its data folder: three battles voted, a second
vote on one refused in one line, another client's vote refused, a follow-up voted again, and the
leaderboard still showing the votes after the app restarts on the same folder."""

from __future__ import annotations

import pytest
from gradio_client import Client, handle_file

from components.chat import NOT_ANSWERED
from kv_arena import service
from tools.app_process import AppProcess

MODEL = "tiny-arena-vl"  # its scenes know the true answers


def battle(client: Client, scene, method="snapkv", budget="0.2", battle_id="", text=None):
    files = [] if battle_id else [handle_file(f) for f in scene.files]
    return client.predict(message={"text": text or scene.questions[0], "files": files}, model=MODEL, method=method,
                          budget=budget, battle=battle_id, api_name="/blind")


def vote(client: Client, battle_id: str, choice: str):
    return client.predict(battle=battle_id, choice=choice, api_name="/vote")


def votes_on(board: dict) -> dict[tuple, int]:
    return {(row[0], row[1], row[2]): row[3] for row in board["data"] if row[3] != ""}


@pytest.fixture
def folder(tmp_path):
    return {"KV_ARENA_DATA_DIR": str(tmp_path / "data"), "KV_ARENA_DB_URL": "", "KV_ARENA_PRELOAD": "0"}


def test_three_battles_voted_a_second_vote_refused_and_the_board_kept_across_a_restart(tmp_path, folder):
    env = {k: v for k, v in folder.items() if k != "KV_ARENA_DB_URL"}  # unset: the SQLite default
    scenes = service.scene_examples()
    with AppProcess(tmp_path / "host", env, model=MODEL) as app:
        client, other = Client(app.url, verbose=False), Client(app.url, verbose=False)
        shown = []
        for scene, method, budget in zip(scenes, ("snapkv", "h2o", "snapkv"), ("0.2", "0.5", "0.2")):
            battle_id, a, b, status, reveal, _, choice = battle(client, scene, method, budget)
            assert len(battle_id) == 32 and a and b and "which answer is better" in status and reveal == ""
            assert choice is None  # the vote control emptied with the answers
            shown.append(battle_id)
        refused = vote(other, shown[0], "A")  # a client that was not shown it
        assert refused[1].startswith(NOT_ANSWERED) and "only on a battle you were shown" in refused[1]
        reveals = [vote(client, battle_id, choice) for battle_id, choice in zip(shown, ("A", "B", "same"))]
        for reveal, status, _ in reveals:
            assert "was the full cache" in reveal and "Vote recorded" in status
        assert "SnapKV" in reveals[0][0] and "budget 0.2" in reveals[0][0] and "KV held" in reveals[0][0]
        again = vote(client, shown[0], "B")
        assert again[1].startswith(NOT_ANSWERED) and "one vote per battle" in again[1] and "\n" not in again[1]
        # a follow-up continues the first battle's conversations, voted on again
        follow = battle(client, scenes[0], battle_id=shown[0], text=scenes[0].questions[1])
        assert follow[0] not in shown and follow[1] and follow[2] and "Turn 2" in follow[3]
        assert "budget 0.2" in vote(client, follow[0], "same")[0]
        board = client.predict(api_name="/leaderboard")
        assert votes_on(board) == {(MODEL, "SnapKV", "0.2"): 3, (MODEL, "H2O (heavy hitters)", "0.5"): 1}
        bad = battle(client, scenes[0], method="nosuch")
        assert bad[3].startswith(NOT_ANSWERED) and "method must be one of" in bad[3]
    assert (tmp_path / "data" / "votes.db").is_file()
    with AppProcess(tmp_path / "host", env, model=MODEL) as app:  # a restart on the same data folder
        board = Client(app.url, verbose=False).predict(api_name="/leaderboard")
        assert sum(votes_on(board).values()) == 4 and votes_on(board)[(MODEL, "SnapKV", "0.2")] == 3


def test_bad_database_settings_are_one_line_at_start(tmp_path, folder):
    app = AppProcess(tmp_path / "host", folder | {"KV_ARENA_DB_URL": "nosuchdb://x/y"}, model=MODEL).launch()
    assert app.process.wait(timeout=120) != 0
    errors = [line for line in app.log().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "votes database" in errors[0] and "Traceback" not in app.log()
