"""The votes database's tables, as the queries see them (SQLAlchemy Core). The migrations
(``migrations/versions``) create them; a change here needs a new revision there.

A battle is one turn of a blind conversation: the full cache's answer and one method's, shown as
A and B. Only hashes of the answers are kept (enough to tell repeats apart, nothing a visitor
wrote), and the client is an HMAC of its cookie id with the deployment's salt (never the raw
cookie or an address); so are the visitor (the address the rates count by, ``service.visitors``)
and a vote's Hugging Face account. The salt itself is a row of ``deployment`` (every replica on
the database reads the same one), unless ``KV_ARENA_SALT`` gives it."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

battles = sa.Table(
    "battles", metadata,
    sa.Column("id", sa.String(32), primary_key=True),  # uuid4 hex, drawn by the server
    sa.Column("thread", sa.String(32), nullable=False),  # the first turn's id: a follow-up continues it
    sa.Column("turn", sa.Integer, nullable=False),  # 1 for the question, 2... for follow-ups
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("method", sa.String(64), nullable=False),
    sa.Column("budget", sa.Float, nullable=False),  # the level asked for
    sa.Column("kv_fraction", sa.Float, nullable=False),  # what the method really held, over the full cache's bytes
    sa.Column("full_kv_bytes", sa.BigInteger, nullable=False),
    sa.Column("method_kv_bytes", sa.BigInteger, nullable=False),
    sa.Column("full_s", sa.Float, nullable=False),  # the model's own time for each answer
    sa.Column("method_s", sa.Float, nullable=False),
    sa.Column("full_side", sa.String(1), nullable=False),  # "A" or "B": where the full cache's answer was shown
    sa.Column("hash_a", sa.String(64), nullable=False),  # sha256 of the answers' text
    sa.Column("hash_b", sa.String(64), nullable=False),
    sa.Column("truth", sa.Text, nullable=True),  # the scene's true answer (the offline model's scenes only)
    sa.Column("full_right", sa.Boolean, nullable=True),
    sa.Column("method_right", sa.Boolean, nullable=True),
    sa.Column("client", sa.String(64), nullable=False),  # salted: HMAC-SHA256 of the client id
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("visitor", sa.String(64), nullable=True),  # salted visitor key: the rate counts by it (0002)
)
sa.Index("ix_battles_client_created", battles.c.client, battles.c.created_at)
sa.Index("ix_battles_visitor_created", battles.c.visitor, battles.c.created_at)

votes = sa.Table(
    "votes", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    # unique: a second vote on a battle fails in the database itself, whichever replica sends it
    sa.Column("battle_id", sa.String(32), sa.ForeignKey("battles.id"), nullable=False, unique=True),
    sa.Column("choice", sa.String(8), nullable=False),  # as voted: "A", "B" or "same"
    sa.Column("verdict", sa.String(8), nullable=False),  # what it means: "full", "method" or "same"
    sa.Column("right", sa.Boolean, nullable=True),  # the vote against the truth, where the scene is known
    sa.Column("client", sa.String(64), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("visitor", sa.String(64), nullable=True),  # salted visitor key (0002)
    # salted Hugging Face username; None: cast signed out (not counted where sign-in is required) (0002)
    sa.Column("account", sa.String(64), nullable=True),
)
sa.Index("ix_votes_client_created", votes.c.client, votes.c.created_at)
sa.Index("ix_votes_visitor_created", votes.c.visitor, votes.c.created_at)
sa.Index("ix_votes_account_created", votes.c.account, votes.c.created_at)

# what the deployment shares through its database: the salt (name "salt"), made by migration 0002
deployment = sa.Table(
    "deployment", metadata,
    sa.Column("name", sa.String(32), primary_key=True),
    sa.Column("value", sa.String(128), nullable=False),
)
