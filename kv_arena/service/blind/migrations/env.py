"""Alembic's environment for the votes database: run on the connection the store hands over
(``config.attributes["connection"]``), never on a URL of its own, so the app's settings decide."""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from kv_arena.service.blind.schema import metadata

LOCK_KEY = 424_242_049  # PostgreSQL advisory lock: replicas starting together migrate one at a time


def run_migrations_online() -> None:
    connection = context.config.attributes["connection"]
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":  # held to the transaction's end; the next replica then finds the head
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("the votes database migrates online only: the app runs it at start (kv_arena.service.blind.store)")
run_migrations_online()
