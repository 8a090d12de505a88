"""Results: ``Task.enqueue`` returns a ``JobRef`` (an int) whose ``result()`` /
``result_async()`` wait for the handler's JSON return value; a job that ends dead or
cancelled raises ``JobFailedError``; no outcome in time raises ``TimeoutError``."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

import skiplock
from skiplock import client, results
from skiplock.retry import RetryPolicy

from .conftest import Sem, StartWorkers

pytestmark = pytest.mark.timeout(60)

# A positive back-off: the retry then comes due through the promoter, whose notification
# rewinds the workers' claim cursors (see test_timeouts.py).
QUICK_RETRY = RetryPolicy(base=0.01, cap=0.01, jitter=0.0)


def test_results_of_many_jobs_across_several_workers(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="square")
    def square(n: int) -> dict[str, Any]:
        return {"n": n, "square": n * n, "by": "sync"}

    @sem.app.task(name="cube")
    async def cube(n: int) -> list[int]:
        return [n, n**3]

    workers(3)
    squares = [sem.enqueue(square, n=n) for n in range(15)]
    cubes = [sem.enqueue(cube, n=n) for n in range(15)]

    for n, ref in enumerate(squares):
        assert ref.result(timeout=20) == {"n": n, "square": n * n, "by": "sync"}

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*(ref.result_async(timeout=20) for ref in cubes)))

    assert asyncio.run(gather()) == [[n, n**3] for n in range(15)]
    # By id, through the App, for ids that came from enqueue_many.
    ids = sem.enqueue_many([square.job(n=n) for n in (100, 101)])
    assert [sem.app.result(job_id, timeout=20)["square"] for job_id in ids] == [10000, 10201]
    assert asyncio.run(sem.app.result_async(ids[0], timeout=20))["n"] == 100


def test_a_dead_job_raises_job_failed_error_naming_its_last_error(
    sem: Sem, workers: StartWorkers
) -> None:
    @sem.app.task(name="flaky", max_attempts=2, retry=QUICK_RETRY)
    def flaky(order: int) -> None:
        attempt = skiplock.current_job().attempts
        raise ValueError(f"order {order}: attempt {attempt} failed")

    workers(2)
    ref = sem.enqueue(flaky, order=9)

    with pytest.raises(
        skiplock.JobFailedError, match=r"is dead; last error ValueError: order 9: attempt 2 failed"
    ):
        ref.result(timeout=20)
    with pytest.raises(skiplock.JobFailedError, match="attempt 2 failed"):
        asyncio.run(ref.result_async(timeout=20))
    job = sem.job(ref)
    assert job.state is skiplock.JobState.DEAD
    assert [error["message"] for error in job.errors] == [
        "order 9: attempt 1 failed",
        "order 9: attempt 2 failed",
    ]


def test_a_cancelled_job_raises_job_failed_error(sem: Sem, workers: StartWorkers) -> None:
    started = threading.Event()

    @sem.app.task(name="idle")
    async def idle() -> str:
        started.set()
        await asyncio.Event().wait()  # until cancelled
        return "never"

    waiting = sem.enqueue(idle.with_options(delay=3600))
    with sem.connect() as conn:
        assert client.cancel_jobs(conn, sem.schema, [waiting]) == 1
    with pytest.raises(skiplock.JobFailedError, match=f"job {int(waiting)} .* is cancelled"):
        waiting.result(timeout=20)

    workers(2)
    running = sem.enqueue(idle)
    with ThreadPoolExecutor(1) as pool:
        outcome = pool.submit(running.result, 20)
        assert started.wait(15)
        sem.wait_for_state(running, "running")
        with sem.connect() as conn:
            assert client.cancel_jobs(conn, sem.schema, [running]) == 1
        with pytest.raises(skiplock.JobFailedError, match="is cancelled; last error Cancelled"):
            outcome.result(timeout=20)


def test_no_outcome_in_time_raises_timeout_error(sem: Sem) -> None:
    @sem.app.task(name="unattended")
    def unattended() -> None: ...

    ref = sem.enqueue(unattended)  # no worker runs it

    with pytest.raises(TimeoutError, match=f"job {int(ref)} did not finish within 0.2s"):
        ref.result(timeout=0.2)
    with pytest.raises(TimeoutError):
        asyncio.run(ref.result_async(timeout=0.2))
    with pytest.raises(TimeoutError):
        sem.app.result(ref, timeout=0)
    assert sem.job(ref).state is skiplock.JobState.AVAILABLE


@pytest.mark.parametrize("how", ["sync", "async"])
def test_the_waiter_is_woken_by_the_notification(
    sem: Sem, workers: StartWorkers, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """With the waiter's fallback poll an hour away and the worker's poll half a minute
    away, only notifications (the enqueue's, then the outcome flush's) can deliver the
    result within the generous bound below."""
    monkeypatch.setattr(results, "POLL_SECONDS", 3600.0)

    @sem.app.task(name="greet")
    def greet(name: str) -> str:
        return f"hello {name}"

    workers(1, poll_interval=30.0)
    ref = sem.enqueue(greet, name="ada")

    def wait() -> Any:
        if how == "sync":
            return ref.result(timeout=40)
        return asyncio.run(ref.result_async(timeout=40))

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(wait).result(timeout=30) == "hello ada"


@pytest.mark.parametrize("how", ["sync", "async"])
def test_the_result_of_a_transactional_job_comes_with_its_writes(
    sem: Sem, workers: StartWorkers, how: str
) -> None:
    sem.execute("CREATE TABLE {schema}.ledger (entry int PRIMARY KEY)")
    insert = f"INSERT INTO {sem.schema}.ledger VALUES (%s) RETURNING entry * 2"

    if how == "sync":

        @sem.app.task(name="book", transactional=True)
        def book(conn: psycopg.Connection[Any], entry: int) -> dict[str, int]:
            row = conn.execute(insert, (entry,)).fetchone()
            assert row is not None
            return {"entry": entry, "doubled": row[0]}

        task: skiplock.Task[Any] = book
    else:

        @sem.app.task(name="book", transactional=True)
        async def book_async(conn: psycopg.AsyncConnection[Any], entry: int) -> dict[str, int]:
            cur = await conn.execute(insert, (entry,))
            row = await cur.fetchone()
            assert row is not None
            return {"entry": entry, "doubled": row[0]}

        task = book_async

    workers(2)
    refs = [sem.enqueue(task, entry=entry) for entry in range(10)]

    assert [ref.result(timeout=20) for ref in refs] == [
        {"entry": entry, "doubled": entry * 2} for entry in range(10)
    ]
    assert sem.execute("SELECT count(*) FROM {schema}.ledger") == [(10,)]
    assert all(sem.job(ref).attempts == 1 for ref in refs)
