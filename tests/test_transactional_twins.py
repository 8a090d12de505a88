"""The two transactional drivers, async and sync, behave alike: each test runs one batch
through both (``run_batch``) and checks the same thing of each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import JobFactory
from skiplock import client, executor
from skiplock.outcomes import Completed, Outcome, Retried, Snoozed
from skiplock.types import ClaimedJob

MODES = ["async", "sync"]
FIXED_NOW = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)


class CountingRandom(random.Random):
    """A random source that counts its draws: what a driver was given must be what it uses."""

    def __init__(self) -> None:
        super().__init__(0)
        self.draws = 0

    def random(self) -> float:
        self.draws += 1
        return super().random()


def run_batch(app: skiplock.App, mode: str, task: str | list[str], **kwargs: Any) -> int:
    """One transactional batch of ``task`` (or tasks) through the ``mode`` driver, on a
    session with synchronous_commit off (as a worker's pool sets it)."""
    options = "-c synchronous_commit=off"
    tasks = [task] if isinstance(task, str) else task
    batch = executor.TransactionalRun(app, "default", tasks, 10, **kwargs)
    if mode == "sync":
        with psycopg.connect(app.database_url, options=options) as conn:
            return executor.run_transactional_sync(conn, batch)

    async def run() -> int:
        conn = await psycopg.AsyncConnection.connect(app.database_url, options=options)
        async with conn:
            return await executor.run_transactional_async(conn, batch)

    return asyncio.run(run())


def register(app: skiplock.App, mode: str, name: str, body: Any) -> None:
    """Register ``body(conn)`` as transactional task ``name``, sync or async as ``mode``."""
    if mode == "sync":

        def sync_handler(conn: psycopg.Connection[Any]) -> Any:
            return body(conn)

        app.task(name=name, transactional=True, max_attempts=5)(sync_handler)
    else:

        async def async_handler(conn: psycopg.AsyncConnection[Any]) -> Any:
            return await body(conn)

        app.task(name=name, transactional=True, max_attempts=5)(async_handler)


def job_row(app: skiplock.App, job_id: int) -> tuple[Any, ...]:
    with psycopg.connect(app.database_url) as conn:
        row = conn.execute(
            "SELECT state, attempts, errors FROM skiplock.jobs WHERE id = %s", (job_id,)
        ).fetchone()
    assert row is not None
    return tuple(row)


@pytest.mark.parametrize("mode", MODES)
def test_a_handlers_writes_commit_durably(
    app: skiplock.App, make_job: JobFactory, mode: str
) -> None:
    """The session's synchronous_commit is off (its outcomes are the worker's to risk); the
    batch's transaction turns it on: a handler's own writes must survive a crash."""
    seen: list[str] = []
    setting = "SELECT current_setting('synchronous_commit')"

    def sync_body(conn: Any) -> None:
        seen.append(conn.execute(setting).fetchone()[0])

    async def async_body(conn: Any) -> None:
        seen.append((await (await conn.execute(setting)).fetchone())[0])

    register(app, mode, "durable", sync_body if mode == "sync" else async_body)
    make_job(task="durable")
    assert run_batch(app, mode, "durable", rng=random.Random(0)) == 1
    assert seen == ["on"]


def assert_charged_with(app: skiplock.App, job_id: int, rng: CountingRandom) -> None:
    """The job's one attempt was counted as lost, stamped FIXED_NOW, backed off with jitter
    drawn from ``rng``."""
    state, attempts, errors = job_row(app, job_id)
    assert (state, attempts) == ("retryable", 1)
    (error,) = errors if isinstance(errors, list) else json.loads(errors)
    assert error["type"] == "SessionLostError"
    assert error["at"] == FIXED_NOW.isoformat()
    assert rng.draws > 0, "the back-off's jitter comes from the random source given"


@pytest.mark.parametrize("mode", MODES)
def test_a_lost_sessions_charge_uses_the_clock_and_random_source_given(
    app: skiplock.App, make_job: JobFactory, mode: str
) -> None:
    """A handler whose session ends under it (here it ends it itself) has its attempt
    counted from another session: with the driver's clock and random source, as every
    other outcome of the batch is."""
    terminate = "SELECT pg_terminate_backend(pg_backend_pid())"

    def sync_body(conn: Any) -> None:
        conn.execute(terminate)

    async def async_body(conn: Any) -> None:
        await conn.execute(terminate)

    register(app, mode, "lost", sync_body if mode == "sync" else async_body)
    job_id = make_job(task="lost")
    rng = CountingRandom()
    with pytest.raises(psycopg.OperationalError):
        run_batch(app, mode, "lost", rng=rng, clock=lambda: FIXED_NOW)
    assert_charged_with(app, job_id, rng)


def job_of(app: skiplock.App, job_id: int) -> skiplock.Job:
    with psycopg.connect(app.database_url) as conn:
        return client.get_job(conn, app.schema, job_id)


@pytest.mark.parametrize("mode", MODES)
def test_each_outcome_reaches_its_row_and_is_told(
    app: skiplock.App, make_job: JobFactory, mode: str
) -> None:
    """A completion, a failure and a snooze in one batch: each row as its outcome says,
    the failing handler's own write rolled back, and each outcome told once, in order."""
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS twin_notes (note text)")
        conn.execute("TRUNCATE twin_notes")
    note = "INSERT INTO twin_notes VALUES (%s)"

    def ok_sync(conn: Any) -> int:
        conn.execute(note, ("ok",))
        return 42

    def fails_sync(conn: Any) -> None:
        conn.execute(note, ("fails",))
        raise ValueError("boom")

    def snoozes_sync(conn: Any) -> None:
        raise skiplock.Snooze(after=60)

    async def ok_async(conn: Any) -> int:
        await conn.execute(note, ("ok",))
        return 42

    async def fails_async(conn: Any) -> None:
        await conn.execute(note, ("fails",))
        raise ValueError("boom")

    async def snoozes_async(conn: Any) -> None:
        raise skiplock.Snooze(after=60)

    bodies = {
        "ok": (ok_sync, ok_async),
        "fails": (fails_sync, fails_async),
        "snoozes": (snoozes_sync, snoozes_async),
    }
    for name, (sync_body, async_body) in bodies.items():
        register(app, mode, name, sync_body if mode == "sync" else async_body)
    ids = {name: make_job(task=name) for name in bodies}
    told: list[tuple[int, Outcome]] = []

    def finished(job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
        told.append((job.id, outcome))

    assert run_batch(app, mode, list(bodies), rng=random.Random(0), on_finished=finished) == 3
    assert [(job_id, type(outcome)) for job_id, outcome in told] == [
        (ids["ok"], Completed),
        (ids["fails"], Retried),
        (ids["snoozes"], Snoozed),
    ]
    done, failed, snoozed = (job_of(app, ids[name]) for name in bodies)
    assert (done.state, done.result, done.attempts) == (skiplock.JobState.COMPLETED, 42, 1)
    assert failed.state is skiplock.JobState.RETRYABLE
    assert [e["type"] for e in failed.errors] == ["ValueError"]
    assert (snoozed.state, snoozed.attempts) == (skiplock.JobState.SCHEDULED, 0)
    with psycopg.connect(app.database_url) as conn:
        notes = conn.execute("SELECT note FROM twin_notes").fetchall()
    assert notes == [("ok",)], "a failed attempt's own writes roll back"


@pytest.mark.parametrize("mode", MODES)
def test_a_stop_asked_before_the_batch_starts_no_job(
    app: skiplock.App, make_job: JobFactory, mode: str
) -> None:
    """The jobs of a batch stopped before it starts go back untouched with its commit."""
    ran: list[str] = []

    def sync_body(conn: Any) -> None:
        ran.append("ran")

    async def async_body(conn: Any) -> None:
        ran.append("ran")

    register(app, mode, "stopped", sync_body if mode == "sync" else async_body)
    job_id = make_job(task="stopped")
    stopping = threading.Event()
    stopping.set()
    stop = executor.BatchStop(stopping)
    assert run_batch(app, mode, "stopped", rng=random.Random(0), stop=stop) == 0
    assert ran == []
    row = job_of(app, job_id)
    assert (row.state, row.attempts) == (skiplock.JobState.AVAILABLE, 0)


def test_a_sync_handler_past_its_timeout_is_charged_with_the_clock_and_random_source_given(
    app: skiplock.App, make_job: JobFactory
) -> None:
    """A sync handler stuck past its timeout cannot be stopped: the server ends its session
    and the watchdog counts the attempt from a session of its own, with the driver's clock
    and random source (the async driver cancels its handler instead: no watchdog)."""
    release = threading.Event()

    @app.task(name="stuck", transactional=True, timeout=0.3, max_attempts=5)
    def stuck(conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT 1")  # the job's transaction is open
        release.wait(20)  # stuck outside SQL: the server ends the idle session

    job_id = make_job(task="stuck")
    rng = CountingRandom()

    def release_once_charged() -> None:
        for _ in range(400):
            if job_row(app, job_id)[1] == 1:
                break
            threading.Event().wait(0.05)
        release.set()

    watcher = threading.Thread(target=release_once_charged)
    watcher.start()
    try:
        # The batch's session is gone when the handler returns: its commit fails.
        with contextlib.suppress(psycopg.Error):
            run_batch(app, "sync", "stuck", rng=rng, clock=lambda: FIXED_NOW)
    finally:
        release.set()
        watcher.join()
    assert_charged_with(app, job_id, rng)
