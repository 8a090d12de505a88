"""A running job whose cancellation was asked, and whose worker then died, ends
cancelled: the rescue must not hand it to another worker (docs/operations.md listed this
as a known bug). Real worker processes, SIGKILLed while the job is in its handler."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from skiplock import client
from test_crash import (  # noqa: F401 - fixtures used by name
    LEASED,
    STEP_TIMEOUT,
    SpawnWorker,
    crash_tables,
    db,
    enqueue,
    executions,
    history,
    history_errors,
    live_job,
    release,
    spawn_worker,
)

pytestmark = pytest.mark.timeout(120)


def test_a_cancelled_job_whose_worker_was_killed_ends_cancelled_and_never_runs_again(
    app: skiplock.App,
    db: psycopg.Connection[Any],  # noqa: F811
    spawn_worker: SpawnWorker,  # noqa: F811
) -> None:
    (job,) = enqueue(app, db, LEASED, hold=True)
    a = spawn_worker(lease=60)
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )
    # The handler ignores the request (a sync handler that never looks at
    # cancel_requested()): the job is still running when its worker dies.
    assert client.cancel_jobs(db, "skiplock", [job]) == 1
    row = live_job(db, job)
    assert row is not None and row["state"] == "running"

    a.kill()
    release(db, job, 2)  # were it run again, the second attempt would finish at once
    b = spawn_worker(lease=60)
    wait_until(
        lambda: history(db, job), STEP_TIMEOUT, what="the job to finish", check=b.check_alive
    )

    assert history(db, job) == [("cancelled", 1, None)]
    assert history_errors(db, job) == [("Cancelled", 1)]
    assert executions(db, job) == [(1, a.pid, False)]


def test_the_rescue_that_finds_the_worker_dead_ends_its_cancelled_job_at_once(
    app: skiplock.App,
    db: psycopg.Connection[Any],  # noqa: F811
    spawn_worker: SpawnWorker,  # noqa: F811
) -> None:
    """The leader is already up when the worker dies: its next rescue pass finds the
    worker gone and must end the job cancelled then, not leave it running under a dead
    worker until the pass for expired leases, half a lease (30 s here) later."""
    b = spawn_worker(lease=60, concurrency=1)  # the leader, its one slot kept busy
    (busy,) = enqueue(app, db, LEASED, hold=True)
    wait_until(
        lambda: executions(db, busy), STEP_TIMEOUT, what="the leader's job", check=b.check_alive
    )
    (job,) = enqueue(app, db, LEASED, hold=True)
    a = spawn_worker(lease=60, concurrency=1)
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )
    assert client.cancel_jobs(db, "skiplock", [job]) == 1

    a.kill()
    release(db, job, 2)
    wait_until(lambda: history(db, job), STEP_TIMEOUT, what="the job to end", check=b.check_alive)

    assert history(db, job) == [("cancelled", 1, None)]
    assert history_errors(db, job) == [("Cancelled", 1)]
    assert executions(db, job) == [(1, a.pid, False)]
    release(db, busy, 1)
