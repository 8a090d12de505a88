"""Snooze: a handler raising ``skiplock.Snooze(after)`` puts its job back, ``scheduled``
until then, without using an attempt and without recording an error."""

from __future__ import annotations

import random
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import skiplock
from skiplock import executor
from skiplock.sql import maintenance, render

from .conftest import Calls, Sem, StartWorkers

pytestmark = pytest.mark.timeout(60)

MODES = ["leased-sync", "leased-async", "transactional-sync", "transactional-async"]


def define(sem: Sem, mode: str, name: str, body: Any, **options: Any) -> skiplock.Task[Any]:
    """Register ``body(**args)`` as a task run in ``mode`` (the connection of a
    transactional handler is not passed on)."""
    if mode == "leased-sync":

        def leased_sync(**args: Any) -> Any:
            return body(**args)

        return sem.app.task(name=name, **options)(leased_sync)
    if mode == "leased-async":

        async def leased_async(**args: Any) -> Any:
            return body(**args)

        return sem.app.task(name=name, **options)(leased_async)
    if mode == "transactional-sync":

        def in_transaction(conn: psycopg.Connection[Any], **args: Any) -> Any:
            return body(**args)

        return sem.app.task(name=name, transactional=True, **options)(in_transaction)

    async def in_transaction_async(conn: psycopg.AsyncConnection[Any], **args: Any) -> Any:
        return body(**args)

    return sem.app.task(name=name, transactional=True, **options)(in_transaction_async)


@pytest.mark.parametrize("mode", MODES)
def test_snoozed_jobs_come_back_without_using_an_attempt(
    sem: Sem, workers: StartWorkers, mode: str
) -> None:
    calls = Calls()

    def not_yet(n: int) -> int:
        if calls.record(n) <= 2:
            raise skiplock.Snooze(0.1)
        return n * 10

    # One attempt allowed: a snooze that counted, or failed, would leave the job dead.
    task = define(sem, mode, "not_yet", not_yet, max_attempts=1)
    workers(3)

    ids = sem.enqueue_many([task.job(n=n) for n in range(12)])

    sem.wait_for_all(ids, "completed")
    assert calls.counts == {n: 3 for n in range(12)}
    for n, job_id in enumerate(ids):
        job = sem.job(job_id)
        assert (job.attempts, job.errors, job.result) == (1, [], n * 10)
    assert sem.live_count() == 0


@pytest.mark.parametrize("mode", ["leased-sync", "transactional-sync"])
def test_a_snoozed_job_is_scheduled_until_its_time(
    sem: Sem, workers: StartWorkers, mode: str
) -> None:
    calls = Calls()
    snoozed = threading.Event()

    def wait_an_hour() -> str:
        if calls.record("x") == 1:
            snoozed.set()
            raise skiplock.Snooze(3600)
        return "awake"

    task = define(sem, mode, "wait_an_hour", wait_an_hour)
    workers(2)
    job_id = sem.enqueue(task)
    assert snoozed.wait(15)

    job = sem.wait_for_state(job_id, "scheduled")
    now = sem.execute("SELECT now()")[0][0]
    assert (job.attempts, job.errors, job.worker_id) == (0, [], None)
    assert now + timedelta(minutes=59) < job.run_at < now + timedelta(minutes=61)

    # Move the clock instead of waiting an hour: due now, it runs at once.
    sem.execute("UPDATE {jobs} SET run_at = now() WHERE id = %s", (job_id,))
    done = sem.wait_for_state(job_id, "completed")
    assert (done.attempts, done.errors, done.result) == (1, [], "awake")
    assert calls.counts["x"] == 2


def test_snooze_takes_seconds_a_timedelta_or_an_aware_datetime(
    sem: Sem, workers: StartWorkers
) -> None:
    until = datetime.now(UTC) + timedelta(hours=2)
    afters: dict[str, float | timedelta | datetime] = {
        "seconds": 3600.0,
        "timedelta": timedelta(hours=1),
        "datetime": until,
    }

    @sem.app.task(name="later")
    def later(kind: str) -> None:
        raise skiplock.Snooze(afters[kind])

    before = sem.execute("SELECT now()")[0][0]
    ids = {kind: sem.enqueue(later, kind=kind) for kind in afters}
    workers(2)

    sem.wait_for_all(list(ids.values()), "scheduled")
    after = sem.execute("SELECT now()")[0][0]
    jobs = {kind: sem.job(job_id) for kind, job_id in ids.items()}
    for kind in ("seconds", "timedelta"):
        assert before + timedelta(hours=1) <= jobs[kind].run_at <= after + timedelta(hours=1)
    # The due time is computed as a delay and added to the database's now when written.
    assert abs(jobs["datetime"].run_at - until) < timedelta(seconds=5)
    assert all((job.attempts, job.errors) == (0, []) for job in jobs.values())


def test_snooze_with_a_naive_datetime_fails_the_attempt_naming_the_mistake(
    sem: Sem, workers: StartWorkers
) -> None:
    """Once a bug: failure_outcome raised TypeError (naive minus aware) outside
    run_leased's try, and the job stayed running until its lease expired."""

    @sem.app.task(name="naive", max_attempts=1)
    def naive() -> None:
        raise skiplock.Snooze(datetime.now() + timedelta(seconds=1))  # naive, by mistake

    workers(1)
    job_id = sem.enqueue(naive)

    job = sem.wait_for_state(job_id, "dead")
    assert [error["type"] for error in job.errors] == ["ValueError"]
    assert "naive datetime" in job.errors[0]["message"]


def test_a_transactional_job_snoozed_after_a_failure_stays_scheduled(sem: Sem) -> None:
    @sem.app.task(name="after_failure", transactional=True)
    def after_failure(conn: psycopg.Connection[Any]) -> None:
        raise skiplock.Snooze(3600)

    job_id = sem.enqueue(after_failure)
    # As JOB_FAIL_LOCKED leaves a job whose first attempt failed with no back-off.
    sem.execute(
        "UPDATE {jobs} SET attempts = 1, retry_at = now() - interval '1 second' WHERE id = %s",
        (job_id,),
    )
    # One transactional batch, run directly: no worker, so no promoter runs meanwhile.
    with sem.connect() as conn:
        claimed = executor.run_transactional_sync(
            conn,
            executor.TransactionalRun(
                sem.app, "default", ["after_failure"], 10, rng=random.Random(0)
            ),
        )
    assert claimed == 1
    assert sem.job(job_id).state is skiplock.JobState.SCHEDULED

    promote = render(maintenance.JOB_PROMOTE_DUE, sem.schema)
    with sem.connect() as conn:
        conn.execute(promote, {"limit": 100, "channel": f"{sem.schema}.jobs"})
    assert sem.job(job_id).state is skiplock.JobState.SCHEDULED
