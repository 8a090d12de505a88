"""Task timeouts (``timeout=``): an async handler is cancelled and the attempt fails with
JobTimeoutError; a sync lease-mode handler's attempt fails the same way while its thread
is abandoned; a sync transactional handler is bounded by the server, which ends its
transaction, and the attempt is counted all the same (decision 002)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from skiplock.retry import RetryPolicy

from .conftest import Calls, Sem, StartWorkers

pytestmark = pytest.mark.timeout(60)

# A positive back-off: the retry then comes due through the promoter, whose notification
# rewinds the workers' claim cursors. With none, the retry waits for a full sweep: see
# the xfail test_worker.py::test_a_failure_without_back_off_runs_again_at_the_next_poll.
QUICK_RETRY = RetryPolicy(base=0.01, cap=0.01, jitter=0.0)


def error_types(job: skiplock.Job) -> list[str]:
    return [error["type"] for error in job.errors]


def test_async_handlers_past_their_timeout_are_cancelled_and_retried_per_attempts(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()

    @sem.app.task(name="fetch", timeout=0.2, max_attempts=2, retry=QUICK_RETRY)
    async def fetch(n: int) -> str:
        attempt = skiplock.current_job().attempts
        calls.record((n, attempt))
        if n % 2 == 0 or attempt == 1:  # even: always too slow; odd: only the first time
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                calls.mark("cancelled", (n, attempt))
                raise
            calls.mark("reached the end", (n, attempt))
        return f"{n} on attempt {attempt}"

    workers(2)
    ids = [sem.enqueue(fetch, n=n) for n in range(6)]

    sem.wait_for_all(ids, "dead", "completed")
    for n, job_id in enumerate(ids):
        job = sem.job(job_id)
        if n % 2 == 0:
            assert (job.state, job.attempts) == (skiplock.JobState.DEAD, 2)
            assert error_types(job) == ["JobTimeoutError", "JobTimeoutError"]
        else:
            assert (job.state, job.result) == (skiplock.JobState.COMPLETED, f"{n} on attempt 2")
            assert error_types(job) == ["JobTimeoutError"]
        assert job.errors[0]["message"] == "fetch exceeded its timeout"
    slow = {(n, 1) for n in range(6)} | {(n, 2) for n in range(0, 6, 2)}
    assert calls.marked("cancelled") == slow
    assert calls.marked("reached the end") == set()
    assert calls.counts == Counter({(n, a): 1 for n in range(6) for a in (1, 2)})


def test_a_sync_lease_handler_past_its_timeout_is_reported_failed_and_abandoned(
    sem: Sem, workers: StartWorkers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="skiplock.executor")
    calls = Calls()
    stop = threading.Event()

    @sem.app.task(name="convert", timeout=0.2, max_attempts=1)
    def convert(n: int) -> str:
        calls.mark("started", n)
        stop.wait(20)  # stuck past the timeout, until the test lets it stop
        calls.mark("returned", n)
        return "too late"

    workers(2)
    ids = [sem.enqueue(convert, n=n) for n in range(3)]
    try:
        sem.wait_for_all(ids, "dead")
        # Failed while the handlers are still running: their threads were abandoned.
        assert calls.marked("returned") == set()
        assert calls.marked("started") == {0, 1, 2}
    finally:
        stop.set()
    wait_until(lambda: calls.marked("returned") == {0, 1, 2}, 15, "the threads to return")

    warned = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert sorted(warned) == sorted(
        f"job {job_id} (convert) timed out; its thread cannot be stopped and is abandoned"
        for job_id in ids
    )
    # The late return changes nothing: the attempt already failed.
    for job_id in ids:
        job = sem.job(job_id)
        assert (job.state, job.result, error_types(job)) == (
            skiplock.JobState.DEAD,
            None,
            ["JobTimeoutError"],
        )


def test_a_stuck_sync_transactional_handler_is_ended_by_the_server(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()
    started = threading.Event()
    release = threading.Event()

    @sem.app.task(name="settle", transactional=True, timeout=0.3, max_attempts=1)
    def settle(conn: psycopg.Connection[Any], batch: int) -> str:
        call = calls.record(batch)
        conn.execute("SELECT 1")  # the handler's transaction is open
        if call == 1:
            started.set()
            release.wait(20)  # stuck outside SQL: the session sits idle in transaction
            return "first"
        return "second"

    # One slot: the stuck thread keeps it, so nothing claims the job while we look.
    workers(1, concurrency=1)
    job_id = sem.enqueue(settle, batch=1)
    assert started.wait(15)

    try:
        # The server ends the stuck session, and the attempt it took with it is counted
        # (issue 10, item 3): with max_attempts=1 the job is dead, not run again.
        job = sem.wait_for_state(job_id, "dead")
        assert (job.attempts, [e["type"] for e in job.errors]) == (1, ["SessionLostError"])
    finally:
        release.set()
    assert calls.counts == Counter({1: 1})
    # The late return changes nothing: its session is gone.
    assert sem.job(job_id).state is skiplock.JobState.DEAD


def test_a_sync_job_queued_behind_an_abandoned_thread_is_not_timed_out_before_it_starts(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()
    release = threading.Event()

    @sem.app.task(name="stuck", timeout=0.2, max_attempts=1)
    def stuck() -> None:
        release.wait(20)

    @sem.app.task(name="quick", timeout=0.2, max_attempts=1)
    def quick() -> str:
        calls.record("quick")
        return "ran"

    # One thread; heartbeats (which touch the worker's row) every half second.
    workers(1, concurrency=1, lease_seconds=1.5)
    first = sem.enqueue(stuck)
    sem.wait_for_state(first, "dead")  # abandoned: its thread is still blocked

    second = sem.enqueue(quick)
    seen: set[Any] = set()

    def heartbeats_since_enqueue() -> int:
        rows = sem.execute("SELECT last_seen_at FROM {workers}")
        seen.update(row[0] for row in rows)
        return len(seen) - 1

    try:
        # Three heartbeats: over a second with `quick` waiting for the only thread, five
        # times its timeout. Or, sooner, `quick` has already failed.
        wait_until(
            lambda: sem.state_of(second) == "dead" or heartbeats_since_enqueue() >= 3,
            15,
            "quick to fail or three heartbeats",
        )
    finally:
        release.set()
    job = sem.wait_for_state(second, "completed", "dead")
    assert (job.state, job.errors) == (skiplock.JobState.COMPLETED, [])
    assert calls.counts == Counter({"quick": 1})


@pytest.mark.parametrize("mode", ["async", "sync", "sync with a timeout", "transactional"])
def test_a_handler_s_own_timeout_error_is_recorded_as_it_was_raised(
    sem: Sem, workers: StartWorkers, mode: str
) -> None:
    """A TimeoutError the handler raises itself (a socket's, an inner wait_for's) is that
    error, with its message and traceback: not 'exceeded its timeout', which only the
    task's own timeout= may say."""
    message = "the payment service did not answer within 5 s"
    options: dict[str, Any] = {"name": "call", "max_attempts": 1}
    if mode == "sync with a timeout":
        options["timeout"] = 30.0
    if mode == "transactional":
        options.update(transactional=True, timeout=30.0)

    if mode in ("async", "transactional"):
        if mode == "transactional":

            @sem.app.task(**options)
            async def call(conn: psycopg.AsyncConnection[Any]) -> None:
                raise TimeoutError(message)
        else:

            @sem.app.task(**options, timeout=30.0)
            async def call() -> None:
                raise TimeoutError(message)
    else:

        @sem.app.task(**options)
        def call() -> None:
            raise TimeoutError(message)

    job_id = sem.enqueue(call)
    workers(1)
    job = sem.wait_for_state(job_id, "dead")
    (error,) = job.errors
    assert (error["type"], error["message"]) == ("TimeoutError", message)
    assert "raise TimeoutError(message)" in (error["traceback"] or "")
