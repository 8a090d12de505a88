"""The jobs a scenario works on: a scratch schema of its own (migrated, dropped afterwards),
argument-less jobs written in one statement or offered as a steady stream, the wait until
none is left to run, and when each probe job started."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.tasks import JobSpec


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
    max_attempts: int = 3,
) -> None:
    """Insert ``count`` argument-less jobs in one statement (setup, not measured). Rows
    written by hand do not get their task's options: pass its ``max_attempts``."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (task, args, state, run_at, max_attempts) "
            "SELECT %s, '{{}}'::jsonb, %s, " + run_at + ", %s FROM generate_series(1, %s)"
        ).format(sql.Identifier(schema, "jobs")),
        (task, state, max_attempts, count),
    )


def offer(
    conn: psycopg.Connection[Any],
    bench_app: App,
    job: Callable[[], JobSpec],
    rate: float,
    tick: float,
    stop: threading.Event,
    committed: dict[int, float] | None = None,
) -> None:
    """Enqueue ``rate`` jobs per second made by ``job``, a transaction every ``tick``
    seconds (the fraction of a job left over carried to the next), until ``stop`` is
    set; with ``committed``, note there each job's commit time (``time.time()``)."""
    carry = 0.0
    next_at = time.monotonic()
    while not stop.is_set():
        carry += rate * tick
        count = int(carry)
        carry -= count
        if count:
            ids = bench_app.enqueue_many(conn, [job() for _ in range(count)])
            conn.commit()
            if committed is not None:
                now = time.time()
                for job_id in ids:
                    committed[job_id] = now
        next_at += tick
        time.sleep(max(0.0, next_at - time.monotonic()))


def wait_drained(conn: psycopg.Connection[Any], schema: str, timeout: float) -> None:
    """Wait until nothing is left to run now (the far-future jobs of the ``scheduled``
    scenario stay, and so would a retry due more than an hour on)."""
    # One EXISTS per state, each read from the partial index that holds that state: a
    # single EXISTS over the four would walk the heap past every idle row (the scheduled
    # and waiting rows of some scenarios) on each poll, and the poll's CPU would come out
    # of the drain it measures.
    # A retry is read through the index of jobs waiting for their time, by how soon it is
    # due: one due more than an hour on is not waited for.
    jobs = sql.Identifier(schema, "jobs")
    query = sql.SQL(" OR ").join(
        [
            *(
                sql.SQL("EXISTS (SELECT 1 FROM {} WHERE state = {})").format(
                    jobs, sql.Literal(state)
                )
                for state in ("blocked", "available", "running")
            ),
            sql.SQL(
                "EXISTS (SELECT 1 FROM {} WHERE state IN ('scheduled', 'retryable') "
                "AND coalesce(retry_at, run_at) < now() + interval '1 hour' "
                "AND state = 'retryable')"
            ).format(jobs),
        ]
    )
    query = sql.SQL("SELECT ") + query
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query).fetchone()
        if row is not None and not row[0]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs did not drain within {timeout}s")
        time.sleep(0.02)


def probe_starts(conn: psycopg.Connection[Any], schema: str, timeout: float) -> dict[int, float]:
    """Once drained (``wait_drained``), when each finished probe job started, by id: the
    ``time.time()`` its handler returned."""
    wait_drained(conn, schema, timeout)
    query = sql.SQL("SELECT id, result::float8 FROM {}").format(
        sql.Identifier(schema, "job_history")
    )
    return dict(conn.execute(query).fetchall())
