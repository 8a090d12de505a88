"""Completion in the handler's own transaction (skiplock.complete): the job's move to
history commits with the handler's writes, fenced by the attempt, and the worker then
writes nothing more for it. Real workers; the handler's transactions are its own
connections'.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until

from .conftest import Sem, StartWorkers

PATIENCE = 30.0
# Short leases: heartbeats every half second, so that one falls between the handler's
# commit and its return.
LEASE = {"lease_seconds": 1.5}


@pytest.fixture
def orders(sem: Sem) -> str:
    sem.execute("CREATE TABLE {schema}.orders (id int PRIMARY KEY, shipped bool)")
    return f'"{sem.schema}".orders'


def test_a_job_completed_in_the_handlers_transaction_commits_with_its_writes(
    sem: Sem, workers: StartWorkers, orders: str, caplog: pytest.LogCaptureFixture
) -> None:
    @sem.app.task(name="follow_up")
    def follow_up(order_id: int) -> None: ...

    @sem.app.task(name="ship")
    def ship(order_id: int) -> str:
        with psycopg.connect(sem.url) as conn, conn.transaction():
            conn.execute(f"INSERT INTO {orders} VALUES (%s, true)", (order_id,))
            follow_up.enqueue(conn, order_id=order_id)
            skiplock.complete(conn, result={"shipped": True})
        threading.Event().wait(1.2)  # heartbeats come and find the row gone: expected
        return "not stored: the job was completed above"

    caplog.set_level(logging.WARNING)
    (worker,) = workers(1, queues=["default"], **LEASE)
    ref = sem.enqueue(ship, order_id=5)
    sem.wait_for_state(ref, "completed", timeout=PATIENCE)
    wait_until(lambda: worker.worker.stats.claimed >= 2, PATIENCE, "the follow-up claimed")
    worker.stop()  # once the handler returned and its outcome was flushed

    job = sem.job(ref)
    assert (job.attempts, job.result) == (1, {"shipped": True})
    assert sem.execute("SELECT id, shipped FROM {schema}.orders") == [(5, True)]
    follow_ups = sem.execute("SELECT count(*) FROM {history} WHERE task = 'follow_up'")
    assert follow_ups == [(1,)]
    complaints = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert complaints == []


def test_a_completion_rolled_back_with_its_transaction_is_as_if_never_asked(
    sem: Sem, workers: StartWorkers, orders: str
) -> None:
    """The caller's transaction rolled back: so did the completion, and the worker
    records the handler's own outcome, as for any job."""

    @sem.app.task(name="ship")
    def ship(order_id: int) -> str:
        with psycopg.connect(sem.url) as conn:
            try:
                with conn.transaction():
                    conn.execute(f"INSERT INTO {orders} VALUES (%s, true)", (order_id,))
                    skiplock.complete(conn, result="in the transaction")
                    raise ValueError("changed our mind")
            except ValueError:
                pass
        return "returned"

    workers(1, **LEASE)
    ref = sem.enqueue(ship, order_id=6)
    sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert sem.job(ref).result == "returned"
    assert sem.execute("SELECT count(*) FROM {schema}.orders") == [(0,)]


@pytest.mark.server_version
def test_an_attempt_that_lost_its_job_cannot_complete_it(
    sem: Sem, workers: StartWorkers, orders: str
) -> None:
    """The fence: the job's attempt moved on (rescued, claimed again elsewhere), so
    complete() raises, and the caller's writes roll back with its transaction."""
    seen: list[BaseException] = []

    @sem.app.task(name="ship", max_attempts=1)
    def ship(order_id: int) -> None:
        job = skiplock.current_job()
        sem.execute("UPDATE {jobs} SET attempts = attempts + 1 WHERE id = %s", (job.id,))
        with psycopg.connect(sem.url) as conn:
            try:
                with conn.transaction():
                    conn.execute(f"INSERT INTO {orders} VALUES (%s, true)", (order_id,))
                    skiplock.complete(conn)
            except skiplock.LeaseLostError as exc:
                seen.append(exc)
                raise

    workers(1, **LEASE)
    ref = sem.enqueue(ship, order_id=7)
    wait_until(lambda: bool(seen), PATIENCE, "the stale attempt's completion")

    assert "no longer holds the job" in str(seen[0])
    assert sem.execute("SELECT count(*) FROM {schema}.orders") == [(0,)]
    assert sem.state_of(ref) == "running"  # still the (pretend) later attempt's


def test_async_handlers_complete_on_an_async_connection(
    sem: Sem, workers: StartWorkers, orders: str
) -> None:
    @sem.app.task(name="ship")
    async def ship(order_id: int) -> None:
        async with (
            await psycopg.AsyncConnection.connect(sem.url) as conn,
            conn.transaction(),
        ):
            await conn.execute(f"INSERT INTO {orders} VALUES (%s, true)", (order_id,))
            await skiplock.complete_async(conn, result=order_id)

    workers(1, **LEASE)
    ref = sem.enqueue(ship, order_id=8)
    sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert sem.job(ref).result == 8
    assert sem.execute("SELECT id FROM {schema}.orders") == [(8,)]


@pytest.mark.parametrize("how", ["twice", "transactional"])
def test_a_completion_that_cannot_be_fails_the_attempt_saying_why(
    sem: Sem, workers: StartWorkers, how: str
) -> None:
    seen: list[BaseException] = []
    if how == "twice":

        @sem.app.task(name="bad", max_attempts=1)
        def twice() -> None:
            with psycopg.connect(sem.url) as conn:
                with conn.transaction():
                    skiplock.complete(conn)
                try:
                    skiplock.complete(conn)
                except skiplock.ConfigurationError as exc:
                    seen.append(exc)

        expected = "was called already for this attempt"
    else:

        @sem.app.task(name="bad", queue="ledger", transactional=True, max_attempts=1)
        def in_transaction(conn: psycopg.Connection[Any]) -> None:
            skiplock.complete(conn)

        expected = "completes with its own transaction already"

    workers(1, queues=["default", "ledger"], **LEASE)
    ref = sem.enqueue(sem.app.tasks["bad"])
    if how == "twice":
        # The first call completed the job; the second is refused, a moment later: the
        # job's state can be read before the handler has made that second call.
        sem.wait_for_state(ref, "completed", timeout=PATIENCE)
        wait_until(lambda: bool(seen), PATIENCE, "the second call's refusal")
        assert len(seen) == 1 and expected in str(seen[0])
        return
    job = sem.wait_for_state(ref, "dead", timeout=PATIENCE)
    assert expected in job.errors[-1]["message"]


def test_complete_outside_a_job_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"skiplock.complete\(\) called outside a running job"):
        skiplock.complete(None)  # type: ignore[arg-type]
