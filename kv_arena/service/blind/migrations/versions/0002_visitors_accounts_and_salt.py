"""Visitors, accounts and one salt: the rates count by the visitor (an address behind the trusted
proxies, never a cookie), a vote keeps the Hugging Face account that cast it (signed-out votes are
kept but shown apart where sign-in is required), and the deployment's salt lives in the database so
every replica hashes alike. All three columns are salted (HMAC-SHA256), nullable: rows written
before this revision have none.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-28
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("battles", sa.Column("visitor", sa.String(64), nullable=True))
    op.create_index("ix_battles_visitor_created", "battles", ["visitor", "created_at"])
    op.add_column("votes", sa.Column("visitor", sa.String(64), nullable=True))
    op.add_column("votes", sa.Column("account", sa.String(64), nullable=True))
    op.create_index("ix_votes_visitor_created", "votes", ["visitor", "created_at"])
    op.create_index("ix_votes_account_created", "votes", ["account", "created_at"])
    deployment = op.create_table(
        "deployment",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("value", sa.String(128), nullable=False),
    )
    # made once, by whichever replica migrates (PostgreSQL: under env.py's advisory lock)
    op.bulk_insert(deployment, [{"name": "salt", "value": secrets.token_hex(32)}])


def downgrade() -> None:
    op.drop_table("deployment")
    op.drop_index("ix_votes_account_created", "votes")
    op.drop_index("ix_votes_visitor_created", "votes")
    with op.batch_alter_table("votes") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("account")
        batch.drop_column("visitor")
    op.drop_index("ix_battles_visitor_created", "battles")
    with op.batch_alter_table("battles") as batch:
        batch.drop_column("visitor")
