"""The jobs of ``bench --scenarios steps-chaos`` (skiplock/bench/steps_chaos.py): written by
hand, so they carry their task's attempts only if the scenario says so, and its loop
waits for the jobs that can still run, never for a dead one. The smoke test runs the
scenario; a job that lost three attempts to kills (the column's default) once held it
until the smoke test's timeout, on a slow machine in CI."""

from __future__ import annotations

from typing import Any

import psycopg

import skiplock
from conftest import SCHEMA
from skiplock.bench import steps_chaos
from skiplock.bench.tasks import app as bench_app


def test_its_jobs_have_their_tasks_attempts_and_a_dead_one_is_not_waited_for(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    steps_chaos.enqueue(conn, SCHEMA, 3)

    attempts = bench_app.tasks[steps_chaos.EFFECTFUL].options.max_attempts
    assert attempts > 100  # one attempt may be lost to each kill
    rows = conn.execute(f'SELECT task, max_attempts FROM "{SCHEMA}".jobs ORDER BY id').fetchall()
    assert rows == [(steps_chaos.EFFECTFUL, attempts)] * 3
    assert steps_chaos.left(conn, SCHEMA) == 3
    conn.execute(
        f"UPDATE \"{SCHEMA}\".jobs SET state = 'dead' "
        f'WHERE id = (SELECT min(id) FROM "{SCHEMA}".jobs)'
    )
    assert steps_chaos.left(conn, SCHEMA) == 2
