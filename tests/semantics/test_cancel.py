"""Cancelling: a waiting job moves to history as cancelled at once; a running lease-mode
job is stopped by its worker (async handlers are cancelled, sync handlers see
``skiplock.cancel_requested()``), told by a notification or, if that was missed, at its
next heartbeat. Either way it ends ``cancelled`` with a ``Cancelled`` error entry."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from skiplock import client

from .conftest import Calls, CliResult, RunCli, Sem, StartWorkers

pytestmark = pytest.mark.timeout(60)


def cancel(sem: Sem, ids: Sequence[int]) -> int:
    with sem.connect() as conn:
        return client.cancel_jobs(conn, sem.schema, ids)


def assert_cancelled_while_running(job: skiplock.Job) -> None:
    assert job.state is skiplock.JobState.CANCELLED
    assert job.attempts == 1
    assert job.result is None
    assert [(e["type"], e["message"]) for e in job.errors] == [
        ("Cancelled", "cancelled while running")
    ]


class Gate:
    """What the handlers of a test share: the jobs that started, and a release."""

    def __init__(self) -> None:
        self.calls = Calls()
        self.release = threading.Event()

    def started(self) -> set[Any]:
        return self.calls.marked("started")


def test_cancel_requested_is_false_outside_a_job() -> None:
    assert skiplock.cancel_requested() is False


def test_cancelling_waiting_jobs_moves_them_to_history_at_once(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()

    @sem.app.task(name="mail", max_attempts=1)
    def mail(n: int) -> int:
        calls.record(n)
        return n

    ids = [sem.enqueue(mail, n=n) for n in range(6)]
    ids.append(sem.enqueue(mail.with_options(delay=3600), n=6))  # scheduled
    sem.execute("UPDATE {jobs} SET state = 'dead' WHERE id = %s", (ids[5],))
    doomed = [ids[1], ids[3], ids[5], ids[6]]

    assert cancel(sem, doomed) == 4

    for job_id in doomed:
        job = sem.job(job_id)
        assert (job.state, job.attempts, job.errors) == (skiplock.JobState.CANCELLED, 0, [])
    assert sem.live_count() == 3
    workers(2)
    sem.wait_for_all([ids[0], ids[2], ids[4]], "completed")
    assert sorted(calls.counts) == [0, 2, 4]
    assert cancel(sem, doomed) == 0  # already gone


def test_cancelling_running_async_jobs_cancels_their_handlers(
    sem: Sem, workers: StartWorkers
) -> None:
    gate = Gate()

    @sem.app.task(name="crunch")
    async def crunch(n: int) -> int:
        gate.calls.mark("started", n)
        try:
            while not gate.release.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            gate.calls.mark("cancelled", n)
            raise
        gate.calls.mark("ended", n)
        return n

    workers(3)
    ids = [sem.enqueue(crunch, n=n) for n in range(8)]
    sem.wait_for_all(ids, "running")
    doomed = {n for n in range(8) if n % 2}

    assert cancel(sem, [ids[n] for n in doomed]) == len(doomed)

    sem.wait_for_all([ids[n] for n in doomed], "cancelled")
    for n in doomed:
        assert_cancelled_while_running(sem.job(ids[n]))
    gate.release.set()
    sem.wait_for_all([ids[n] for n in range(8) if n not in doomed], "completed")
    assert gate.started() == set(range(8))
    assert gate.calls.marked("cancelled") == doomed
    assert gate.calls.marked("ended") == set(range(8)) - doomed
    # The workers carry on with new work.
    more = [sem.enqueue(crunch, n=n) for n in range(8, 12)]
    sem.wait_for_all(more, "completed")
    assert sem.live_count() == 0


def test_cancelling_running_sync_jobs_that_check_for_it(sem: Sem, workers: StartWorkers) -> None:
    gate = Gate()

    @sem.app.task(name="export")
    def export(n: int) -> int:
        gate.calls.mark("started", n)
        while not gate.release.wait(0.01):
            if skiplock.cancel_requested():
                gate.calls.mark("saw the request", n)
                raise InterruptedError("stopping as asked")
        gate.calls.mark("ended", n)
        return n

    workers(3)
    ids = [sem.enqueue(export, n=n) for n in range(6)]
    sem.wait_for_all(ids, "running")
    doomed = {0, 4, 5}

    assert cancel(sem, [ids[n] for n in doomed]) == len(doomed)

    sem.wait_for_all([ids[n] for n in doomed], "cancelled")
    for n in doomed:
        # The handler's own exception is not a failure: only the cancellation is recorded.
        assert_cancelled_while_running(sem.job(ids[n]))
    assert gate.calls.marked("saw the request") == doomed
    gate.release.set()
    sem.wait_for_all([ids[n] for n in range(6) if n not in doomed], "completed")
    assert gate.calls.marked("ended") == set(range(6)) - doomed
    more = sem.enqueue(export, n=6)
    assert more.result(timeout=20) == 6


def test_a_sync_job_that_returns_early_when_asked_ends_cancelled(
    sem: Sem, workers: StartWorkers
) -> None:
    started = threading.Event()

    @sem.app.task(name="scan")
    def scan() -> str:
        started.set()
        while not skiplock.cancel_requested():
            threading.Event().wait(0.01)
        return "partial"

    workers(1)
    job_id = sem.enqueue(scan)
    assert started.wait(15)
    sem.wait_for_state(job_id, "running")

    assert cancel(sem, [job_id]) == 1

    assert_cancelled_while_running(sem.wait_for_state(job_id, "completed", "cancelled"))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_missed_cancel_notification_is_caught_up_by_the_heartbeat(
    sem: Sem, workers: StartWorkers, kind: str
) -> None:
    gate = Gate()

    def sync_body() -> str:
        gate.calls.mark("started", "job")
        while not skiplock.cancel_requested():
            if gate.release.wait(0.01):
                return "not cancelled"
        raise InterruptedError("stopping as asked")

    async def async_body() -> str:
        gate.calls.mark("started", "job")
        while not gate.release.is_set():
            await asyncio.sleep(0.01)
        return "not cancelled"

    task = sem.app.task(name="long")(sync_body if kind == "sync" else async_body)
    # Heartbeats every lease / 3 = 0.5 s.
    workers(2, lease_seconds=1.5)
    job_id = sem.enqueue(task)
    sem.wait_for_state(job_id, "running")

    # The request as JOB_CANCEL_RUNNING records it, without its notification.
    sem.execute("UPDATE {jobs} SET cancel_requested_at = now() WHERE id = %s", (job_id,))

    try:
        job = sem.wait_for_state(job_id, "cancelled", "completed")
    finally:
        gate.release.set()
    assert_cancelled_while_running(job)


def test_a_cancel_the_database_rolls_back_says_so_and_to_run_it_again(
    sem: Sem, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadlock is not a lost connection: the command's transaction was rolled back,
    nothing it changed was kept, and running it again is the remedy. Here another session
    holds the second of two jobs, waits for the cancel to stop on it, then asks for the
    first, which the cancel holds: PostgreSQL breaks the cycle by failing the cancel (its
    deadlock_timeout the shorter)."""

    @sem.app.task(name="mail", queue="elsewhere")
    def mail(n: int) -> None: ...

    first, second = sem.enqueue(mail, n=1), sem.enqueue(mail, n=2)
    monkeypatch.setenv("PGOPTIONS", "-c deadlock_timeout=3s")  # the CLI's session
    lock = f'SELECT 1 FROM "{sem.schema}".jobs WHERE id = %s FOR UPDATE'
    with sem.connect(autocommit=False) as holder:
        holder.execute("SET deadlock_timeout = '60s'")
        holder.execute(lock, (second,))
        results: list[CliResult] = []
        thread = threading.Thread(
            target=lambda: results.append(
                run_cli("jobs", "cancel", "--all", "--queue", "elsewhere", "--yes")
            )
        )
        thread.start()
        wait_until(
            lambda: sem.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> %s AND wait_event_type = 'Lock' AND query LIKE %s",
                (holder.info.backend_pid, f"%{sem.schema}%"),
            )[0][0],
            10,
            "the cancel to wait for the second job",
        )
        with pytest.raises(psycopg.errors.LockNotAvailable), holder.transaction():
            holder.execute(lock + " NOWAIT", (first,))  # the cancel holds the first
        holder.execute(lock, (first,))  # returns once the cancel was rolled back
        holder.rollback()
        thread.join(30)

    (result,) = results
    assert result.code == 2
    assert "rolled back" in result.err and "deadlock detected" in result.err, result
    assert "run the command again" in result.err, result
    assert "cannot reach" not in result.err, result
    assert [sem.state_of(first), sem.state_of(second)] == ["available", "available"]


def test_the_cli_cancels_a_running_job(sem: Sem, workers: StartWorkers, run_cli: RunCli) -> None:
    gate = Gate()

    @sem.app.task(name="render")
    async def render_video(n: int) -> None:
        gate.calls.mark("started", n)
        await asyncio.Event().wait()

    workers(2)
    job_id = sem.enqueue(render_video, n=1)
    sem.wait_for_state(job_id, "running")

    done = run_cli("jobs", "cancel", str(job_id))

    assert (done.code, done.err) == (0, "")
    assert f"job {job_id} " in done.out
    assert_cancelled_while_running(sem.wait_for_state(job_id, "cancelled"))
    assert gate.started() == {1}
