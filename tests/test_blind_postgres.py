"""The votes database on a real PostgreSQL (Debian's ``postgresql``, started by the test; skipped
where it is not installed): two ``python app.py`` processes on one database, votes from both
counted once (the same battle voted through both at once: one vote), and the database killed: a
vote is refused in one line, every vote acknowledged before is still there when it is back, and
the refused one can be cast then."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from gradio_client import Client, handle_file

from components.chat import NOT_ANSWERED
from components.clients import COOKIE
from kv_arena import service
from tests.postgres_server import LocalPostgres, binaries
from tools.app_process import AppProcess

pytestmark = pytest.mark.skipif(binaries() is None, reason="no PostgreSQL installed (apt-get install postgresql; "
                                "./.ci/run installs it)")
MODEL = "tiny-arena-vl"


def battle(client: Client, scene) -> str:
    battle_id, a, b, status, *_ = client.predict(
        message={"text": scene.questions[0], "files": [handle_file(f) for f in scene.files]}, model=MODEL,
        method="snapkv", budget="0.3", battle="", api_name="/blind")
    assert len(battle_id) == 32, status
    return battle_id


def vote(client: Client, battle_id: str, choice: str = "A") -> str:
    return client.predict(battle=battle_id, choice=choice, api_name="/vote")[1]


def stored_votes(url: str) -> set[str]:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as c:
            return set(c.execute(sa.text("SELECT battle_id FROM votes")).scalars())
    finally:
        engine.dispose()


def test_two_app_processes_on_one_postgresql_count_every_vote_once_and_survive_a_killed_database(tmp_path):
    scenes = service.scene_examples()
    with LocalPostgres() as db:
        env = {"KV_ARENA_DB_URL": db.url, "KV_ARENA_DATA_DIR": str(tmp_path / "data"), "KV_ARENA_PRELOAD": "0"}
        first = AppProcess(tmp_path / "one", env, model=MODEL).launch()
        second = AppProcess(tmp_path / "two", env, model=MODEL).launch()  # both migrate at once: one does
        with first.wait(), second.wait():
            one = Client(first.url, verbose=False)
            # the same visitor on the other replica (its cookie, as a sticky-less balancer would send it)
            two = Client(second.url, verbose=False, httpx_kwargs={"cookies": {COOKIE: one.cookies[COOKIE]}})
            own = Client(second.url, verbose=False)
            mine, theirs = battle(one, scenes[0]), battle(own, scenes[1])
            with ThreadPoolExecutor(2) as pool:  # one battle voted through both replicas at once
                said = list(pool.map(lambda c: vote(c, mine), (one, two)))
            assert sorted("Vote recorded" in s for s in said) == [False, True], said
            assert any("one vote per battle" in s for s in said)
            assert "Vote recorded" in vote(own, theirs, "same")
            acknowledged = {mine, theirs}
            for client in (one, own):  # both replicas count each vote once
                board = client.predict(api_name="/leaderboard")
                assert [row[3] for row in board["data"]] == [2]
            assert stored_votes(db.url) == acknowledged

            pending = battle(one, scenes[2])
            db.kill()
            status = vote(one, pending)
            assert status.startswith(NOT_ANSWERED) and "votes database is unreachable" in status and "\n" not in status
            refused = own.predict(  # a battle, too: nothing to write it to
                message={"text": scenes[0].questions[0], "files": [handle_file(f) for f in scenes[0].files]},
                model=MODEL, method="snapkv", budget="0.3", battle="", api_name="/blind")[3]
            assert refused.startswith(NOT_ANSWERED) and "unreachable" in refused
            db.start()  # back, on the same folder: nothing acknowledged was lost
            assert stored_votes(db.url) == acknowledged
            assert "Vote recorded" in vote(one, pending)  # the refused vote, cast again
            assert stored_votes(db.url) == acknowledged | {pending}
        for app in (first, second):
            assert "Traceback" not in app.log(), app.log()[-3000:]
