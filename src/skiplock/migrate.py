"""Versioned schema migrations: numbered SQL files applied in order, each in a transaction.

Each file runs with ``search_path`` set to the target schema, so one set of files serves
any schema name. Concurrent ``migrate`` calls serialise on an advisory lock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from skiplock.config import validate_schema
from skiplock.errors import SchemaNotReadyError

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str = field(repr=False)


def available_migrations() -> list[Migration]:
    """Every migration shipped with this version of skiplock, in order."""
    found = []
    for entry in resources.files("skiplock.migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    return found


def head_version() -> int:
    return available_migrations()[-1].version


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> set[int]:
    """Versions recorded in the schema's ledger (empty when the schema does not exist)."""
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".schema_migrations',)
    ).fetchone()
    if not exists or not exists[0]:
        return set()
    rows = conn.execute(
        sql.SQL("SELECT version FROM {}.schema_migrations").format(sql.Identifier(schema))
    ).fetchall()
    return {int(row[0]) for row in rows}


def pending_migrations(conn: psycopg.Connection[Any], schema: str) -> list[Migration]:
    done = applied_versions(conn, schema)
    return [m for m in available_migrations() if m.version not in done]


def migrate(
    conn: psycopg.Connection[Any], schema: str, *, target: int | None = None
) -> list[Migration]:
    """Apply pending migrations up to ``target`` (default: all). Returns what was applied.

    All pending migrations apply in one transaction (PostgreSQL DDL is transactional), so
    a failure leaves the schema exactly as it was, never half-way.
    """
    validate_schema(schema)
    ident = sql.Identifier(schema)
    applied: list[Migration] = []
    with conn.transaction():
        # One migrator at a time per schema; the lock ends with this transaction.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"skiplock.migrate.{schema}",))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(sql.SQL(_CREATE_LEDGER).format(schema=ident))
        for migration in pending_migrations(conn, schema):
            if target is not None and migration.version > target:
                break
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(ident))
                conn.execute(migration.sql.encode())
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)"
                    ).format(ident),
                    (migration.version, migration.name),
                )
            applied.append(migration)
    return applied


def check_schema_ready(conn: psycopg.Connection[Any], schema: str) -> None:
    """Fail with the command to run when the schema is missing or behind."""
    pending = pending_migrations(conn, schema)
    if pending:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in pending)
        raise SchemaNotReadyError(
            f"schema {schema!r} is missing migrations ({names}); "
            "run `skiplock migrate` (or App.migrate()) first"
        )
