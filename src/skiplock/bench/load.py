"""The jobs a scenario works on: a scratch schema of its own (migrated, dropped afterwards),
argument-less jobs written in one statement, and the wait until none is left to run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App


@contextmanager
def fresh_schema(url: str, schema: str) -> Iterator[App]:
    bench_app = App(url, schema=schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    bench_app.migrate()
    try:
        yield bench_app
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def copy_jobs(
    conn: psycopg.Connection[Any],
    schema: str,
    task: str,
    count: int,
    *,
    state: str = "available",
    run_at: str = "now()",
) -> None:
    """Insert ``count`` argument-less jobs in one statement (setup, not measured)."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (task, args, state, run_at) "
            "SELECT %s, '{{}}'::jsonb, %s, " + run_at + " FROM generate_series(1, %s)"
        ).format(sql.Identifier(schema, "jobs")),
        (task, state, count),
    )


def wait_drained(conn: psycopg.Connection[Any], schema: str, timeout: float) -> None:
    """Wait until nothing is left to run now (the far-future jobs of the ``scheduled``
    scenario stay)."""
    query = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {} "
        "WHERE state IN ('blocked', 'available', 'running', 'retryable'))"
    ).format(sql.Identifier(schema, "jobs"))
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query).fetchone()
        if row is not None and not row[0]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs did not drain within {timeout}s")
        time.sleep(0.02)
