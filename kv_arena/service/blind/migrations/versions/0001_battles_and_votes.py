"""Battles and votes: the two tables of the "Can you tell?" tab.

Revision ID: 0001
Revises:
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "battles",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("thread", sa.String(32), nullable=False),
        sa.Column("turn", sa.Integer, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("method", sa.String(64), nullable=False),
        sa.Column("budget", sa.Float, nullable=False),
        sa.Column("kv_fraction", sa.Float, nullable=False),
        sa.Column("full_kv_bytes", sa.BigInteger, nullable=False),
        sa.Column("method_kv_bytes", sa.BigInteger, nullable=False),
        sa.Column("full_s", sa.Float, nullable=False),
        sa.Column("method_s", sa.Float, nullable=False),
        sa.Column("full_side", sa.String(1), nullable=False),
        sa.Column("hash_a", sa.String(64), nullable=False),
        sa.Column("hash_b", sa.String(64), nullable=False),
        sa.Column("truth", sa.Text, nullable=True),
        sa.Column("full_right", sa.Boolean, nullable=True),
        sa.Column("method_right", sa.Boolean, nullable=True),
        sa.Column("client", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_battles_client_created", "battles", ["client", "created_at"])
    op.create_table(
        "votes",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("battle_id", sa.String(32), sa.ForeignKey("battles.id"), nullable=False, unique=True),
        sa.Column("choice", sa.String(8), nullable=False),
        sa.Column("verdict", sa.String(8), nullable=False),
        sa.Column("right", sa.Boolean, nullable=True),
        sa.Column("client", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_votes_client_created", "votes", ["client", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_votes_client_created", "votes")
    op.drop_table("votes")
    op.drop_index("ix_battles_client_created", "battles")
    op.drop_table("battles")
