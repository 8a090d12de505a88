"""What a job is charged, and what a cancel request becomes, when its worker goes away.

- A job claimed ahead (``prefetch``) that never started is not charged an attempt when its
  worker is killed: rescue gives the claim's attempt back (decision 015). A job that did
  start is charged, and a job rescued uncounted once is charged the next time, so a
  handler that kills its worker at once still ends dead after max_attempts.
- A job released at shutdown whose cancellation was asked for ends cancelled, as the
  requester was told; and ``skiplock jobs retry`` clears a stale cancel request, so the
  retried job is not cancelled by its next worker's heartbeat.

The SIGKILL tests run real worker processes (``tests.crash_app``, fixtures of
``test_crash``); the others run an in-process worker.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import skiplock
import test_crash
from conftest import JobFactory, StartWorker, wait_until
from conftest import wait_until as wait_for
from skiplock import cli, client
from test_crash import (
    LEASED,
    STEP_TIMEOUT,
    SpawnWorker,
    all_finished,
    enqueue,
    executions,
    history,
    leased_by,
    release,
)
from test_worker import state_of

# The crash tests' fixtures: the worker processes and the tables their handlers write.
crash_tables = test_crash.crash_tables
db = test_crash.db
spawn_worker = test_crash.spawn_worker

# -- prefetched jobs of a killed worker ----------------------------------------------------


def start_recorded(conn: psycopg.Connection[Any], job_id: int) -> bool:
    """Whether the job's start is recorded in its row (its claimed-ahead mark is cleared).
    Read through to_jsonb, so that on a schema without the mark there is nothing to wait
    for and the test fails on what it checks."""
    row = conn.execute(
        "SELECT to_jsonb(j) -> 'claimed_ahead' FROM skiplock.jobs AS j WHERE id = %s", (job_id,)
    ).fetchone()
    return row is not None and row[0] is not True


def attempts_in_history(conn: psycopg.Connection[Any], job_ids: Sequence[int]) -> list[int]:
    return [history(conn, job)[0][1] for job in job_ids]


def test_prefetched_jobs_that_never_started_are_not_charged_when_their_worker_dies(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    jobs = enqueue(app, db, LEASED, count=3, hold=True)
    a = spawn_worker(lease=60, concurrency=1, prefetch=2)
    wait_until(
        lambda: (
            leased_by(db, jobs) == [str(a.id)] * 3
            and sum(bool(executions(db, job)) for job in jobs) == 1
        ),
        STEP_TIMEOUT,
        what="one job to run and two to wait prefetched",
        check=a.check_alive,
    )
    started = next(job for job in jobs if executions(db, job))
    waited = [job for job in jobs if job != started]
    wait_until(lambda: start_recorded(db, started), STEP_TIMEOUT, what="the start to be recorded")

    a.kill()
    for job in jobs:
        release(db, job, 1)
        release(db, job, 2)
    b = spawn_worker(lease=60, concurrency=4)
    wait_until(
        lambda: all_finished(db, jobs), STEP_TIMEOUT, what="every job to run", check=b.check_alive
    )

    # The started job used up its first attempt; the two that waited run as attempt 1.
    assert attempts_in_history(db, [started]) == [2]
    assert attempts_in_history(db, waited) == [1, 1]
    assert [executions(db, job) for job in waited] == [[(1, b.pid, True)]] * 2


def test_a_prefetched_job_that_started_is_charged_when_its_worker_dies(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """One slot and one job ahead: the first job finishes, the prefetched one starts in its
    slot, and once its start is recorded a kill charges it."""
    first, second = enqueue(app, db, LEASED, count=2, hold=True)
    a = spawn_worker(lease=60, concurrency=1, prefetch=1)
    wait_until(
        lambda: leased_by(db, [first, second]) == [str(a.id)] * 2 and executions(db, first),
        STEP_TIMEOUT,
        what="the first job to run and the second to wait prefetched",
        check=a.check_alive,
    )
    release(db, first, 1)
    wait_until(lambda: executions(db, second), STEP_TIMEOUT, what="the second job to start")
    wait_until(lambda: start_recorded(db, second), STEP_TIMEOUT, what="its start recorded")

    a.kill()
    release(db, second, 2)
    b = spawn_worker(lease=60, concurrency=4)
    wait_until(
        lambda: all_finished(db, [second]), STEP_TIMEOUT, what="the job to run", check=b.check_alive
    )

    assert attempts_in_history(db, [second]) == [2]


# -- rescue of rows claimed ahead ------------------------------------------------------------

UNCOUNTED = {
    "attempt": 1,
    "at": "2026-01-01T00:00:00+00:00",
    "type": "WorkerLost",
    "message": "worker lost before the job started; the attempt is not counted",
    "traceback": None,
    "counted": False,
}


def running_row(
    app: skiplock.App, make_job: JobFactory, *, ahead: bool, errors: list[dict[str, Any]]
) -> int:
    """A job running on a worker that is gone (registered, its liveness lock free)."""
    worker = uuid.uuid4()
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO skiplock.workers (id, host, pid, queues, concurrency, holds_lock)"
            " VALUES (%s, 'gone', 1, '{default}', 1, true)",
            (worker,),
        )
    job_id = make_job(
        task="noop",
        state="running",
        attempts=1,
        max_attempts=1,
        worker_id=worker,
        lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
        errors=errors,
    )
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        conn.execute("UPDATE skiplock.jobs SET claimed_ahead = %s WHERE id = %s", (ahead, job_id))
    return job_id


def rescued(conn: psycopg.Connection[Any], job_id: int) -> tuple[str, int, list[Any]]:
    row = conn.execute(
        "SELECT state, attempts, errors FROM skiplock.jobs WHERE id = %s AND worker_id IS NULL",
        (job_id,),
    ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), [(e["type"], e.get("counted", True)) for e in row[2]]


@pytest.mark.parametrize(
    ("ahead", "errors", "expected"),
    [
        (True, [], ("available", 0, [("WorkerLost", False)])),
        # Rescued uncounted once already: this time it counts (and with one attempt
        # allowed, the job is dead), so a handler that kills its worker ends.
        (True, [UNCOUNTED], ("dead", 1, [("WorkerLost", False), ("WorkerLost", True)])),
        (False, [], ("dead", 1, [("WorkerLost", True)])),
    ],
    ids=["ahead", "ahead-again", "started"],
)
def test_rescue_gives_back_the_attempt_of_a_job_that_never_started_once(
    app: skiplock.App,
    make_job: JobFactory,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    ahead: bool,
    errors: list[dict[str, Any]],
    expected: tuple[str, int, list[Any]],
) -> None:
    job_id = running_row(app, make_job, ahead=ahead, errors=errors)
    # The rescuer serves another queue: the rescued job stays where rescue put it.
    start_worker(app, queues=["elsewhere"], rescue_interval=0.05, poll_interval=0.05)
    wait_for(
        lambda: autocommit.execute(
            "SELECT 1 FROM skiplock.jobs WHERE id = %s AND worker_id IS NULL", (job_id,)
        ).fetchone(),
        10.0,
        "the job to be rescued",
    )

    assert rescued(autocommit, job_id) == expected


# -- cancel requests -----------------------------------------------------------------------


def test_a_job_released_at_shutdown_whose_cancel_was_asked_for_ends_cancelled(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    """A sync handler that never looks at cancel_requested() is still running when the
    shutdown timeout passes: the job is released, and it ends cancelled, as asked."""
    running = threading.Event()
    finish = threading.Event()

    @app.task(name="stubborn")
    def stubborn() -> None:
        running.set()
        finish.wait(30.0)

    handle = start_worker(app, shutdown_timeout=0.2, poll_interval=0.05)
    try:
        with psycopg.connect(app.database_url) as conn:
            job_id = stubborn.enqueue(conn)
        assert running.wait(10.0)
        client.cancel_jobs(autocommit, app.schema, [job_id])

        handle.stop()

        assert state_of(autocommit, job_id) == "cancelled"
        assert handle.worker.abandoned_threads == 1
    finally:
        finish.set()


def test_jobs_retry_clears_a_stale_cancel_request(
    app: skiplock.App,
    make_job: JobFactory,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A dead job that still carries a cancel request is retried by hand: it runs to the
    end, through heartbeats that would carry the old request to its worker."""
    lease = 0.3

    @app.task(name="patient")
    async def patient() -> str:
        # Outlive two heartbeats (every third of the lease): each extends the lease.
        job_id = skiplock.current_job().id
        async with await psycopg.AsyncConnection.connect(app.database_url, autocommit=True) as own:
            seen: set[Any] = set()
            while len(seen) < 3:
                cur = await own.execute(
                    "SELECT lease_expires_at FROM skiplock.jobs WHERE id = %s", (job_id,)
                )
                row = await cur.fetchone()
                assert row is not None
                seen.add(row[0])
                await asyncio.sleep(0.02)
        return "done"

    job_id = make_job(task="patient", state="dead", attempts=3, max_attempts=3)
    autocommit.execute(
        "UPDATE skiplock.jobs SET cancel_requested_at = now() - interval '1 minute',"
        " errors = %s WHERE id = %s",
        (Jsonb([UNCOUNTED]), job_id),
    )

    code = cli.main(
        ["--database-url", app.database_url, "--schema", app.schema, "jobs", "retry", str(job_id)]
    )
    capsys.readouterr()
    assert code == 0
    start_worker(app, lease_seconds=lease, poll_interval=0.05)
    wait_for(lambda: state_of(autocommit, job_id) in ("completed", "cancelled"), 15.0, "an end")

    assert state_of(autocommit, job_id) == "completed"
