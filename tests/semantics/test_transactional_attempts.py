"""Transactional mode cannot livelock (issue 10, item 3), with real workers.

A job whose completion PostgreSQL refuses, or whose handler raises with a message it
cannot store, uses up an attempt and ends dead after max_attempts, its writes rolled back,
while the other jobs of its batch run once each. A timeout set for one job does not last
into the next job of the batch. A sync job that hangs past its timeout (the server ends
its session) is counted each time, and ends dead.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from semantics.conftest import Calls, Sem, StartWorkers
from skiplock.retry import RetryPolicy

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

NO_RETRY_DELAY = RetryPolicy(base=0.0, cap=0.0, jitter=0.0)
GOOD_JOBS = 4


def _marks_table(sem: Sem) -> sql.Composed:
    """A table the handlers write to in the job's transaction: what commits shows there."""
    table = sql.Identifier(sem.schema, "marks")
    with sem.connect() as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (task text, n int)").format(table))
    return sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table)


def _marks(sem: Sem) -> list[tuple[str, int]]:
    with sem.connect() as conn:
        rows = conn.execute(
            sql.SQL("SELECT task, n FROM {} ORDER BY 1, 2").format(
                sql.Identifier(sem.schema, "marks")
            )
        ).fetchall()
    return [(str(task), int(n)) for task, n in rows]


BAD_ENDINGS = {
    "result with NUL": (lambda: "a\x00b", "result not storable: "),
    "result inf": (lambda: float("inf"), "result not storable: "),
    "message with NUL": (lambda: (_ for _ in ()).throw(ValueError("x\x00y")), "x\\x00y"),
    "message with a lone surrogate": (
        lambda: (_ for _ in ()).throw(ValueError("\ud800")),
        "\\ud800",
    ),
}


@pytest.mark.parametrize(("ending", "message"), BAD_ENDINGS.values(), ids=BAD_ENDINGS.keys())
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_job_whose_outcome_cannot_be_stored_uses_its_attempts_and_ends_dead(
    sem: Sem, workers: StartWorkers, ending: Any, message: str, flavour: str
) -> None:
    insert = _marks_table(sem)
    calls = Calls()

    if flavour == "sync":

        @sem.app.task(name="bad", transactional=True, max_attempts=2, retry=NO_RETRY_DELAY)
        def bad(conn: psycopg.Connection[Any]) -> Any:
            conn.execute(insert, ("bad", calls.record("bad")))
            return ending()

        @sem.app.task(name="good", transactional=True)
        def good(conn: psycopg.Connection[Any], n: int) -> int:
            calls.record(("good", n))
            conn.execute(insert, ("good", n))
            return n

    else:

        @sem.app.task(name="bad", transactional=True, max_attempts=2, retry=NO_RETRY_DELAY)
        async def bad(conn: psycopg.AsyncConnection[Any]) -> Any:
            await conn.execute(insert, ("bad", calls.record("bad")))
            return ending()

        @sem.app.task(name="good", transactional=True)
        async def good(conn: psycopg.AsyncConnection[Any], n: int) -> int:
            calls.record(("good", n))
            await conn.execute(insert, ("good", n))
            return n

    # The bad job first in line, the good ones behind it in the same batch.
    bad_id = sem.enqueue(bad)
    good_ids = [sem.enqueue(good, n=n) for n in range(GOOD_JOBS)]
    workers(1)

    dead = sem.wait_for_state(bad_id, "dead")
    assert dead.attempts == 2
    assert [e["message"].startswith(message) for e in dead.errors] == [True, True], dead.errors
    sem.wait_for_all(good_ids, "completed")
    expected: dict[Any, int] = {"bad": 2, **{("good", n): 1 for n in range(GOOD_JOBS)}}
    assert calls.counts == expected
    # The bad job's writes rolled back with each attempt; the good ones' committed.
    assert _marks(sem) == [("good", n) for n in range(GOOD_JOBS)]


def test_a_timeout_set_for_one_job_does_not_last_into_the_next_of_its_batch(
    sem: Sem, workers: StartWorkers
) -> None:
    read = (
        "SELECT current_setting('statement_timeout'), "
        "current_setting('idle_in_transaction_session_timeout')"
    )

    def limits(conn: psycopg.Connection[Any]) -> list[str]:
        row = conn.execute(read).fetchone()
        assert row is not None
        return [str(row[0]), str(row[1])]

    @sem.app.task(name="limited", transactional=True, timeout=30)
    def limited(conn: psycopg.Connection[Any]) -> list[str]:
        return limits(conn)

    @sem.app.task(name="free", transactional=True)
    def free(conn: psycopg.Connection[Any]) -> list[str]:
        return limits(conn)

    with sem.connect() as conn:
        session_own = limits(conn)
    # One batch, in this order: limited, free, limited, free.
    ids = [sem.enqueue(task) for task in (limited, free, limited, free)]
    workers(1, transactional_batch=10)

    sem.wait_for_all(ids, "completed")
    results = [sem.job(job_id).result for job_id in ids]
    assert results == [["30s", "30s"], session_own, ["30s", "30s"], session_own]


def test_a_sync_job_that_always_hangs_is_counted_and_ends_dead(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()
    release = threading.Event()

    @sem.app.task(
        name="hang", transactional=True, timeout=0.3, max_attempts=2, retry=NO_RETRY_DELAY
    )
    def hang(conn: psycopg.Connection[Any]) -> str:
        calls.record("hang")
        conn.execute("SELECT 1")  # the job's transaction is open
        release.wait(60)  # stuck outside SQL: the server ends the idle session
        return "late"

    @sem.app.task(name="fine", transactional=True)
    def fine(conn: psycopg.Connection[Any]) -> str:
        calls.record("fine")
        return "ok"

    try:
        job_id = sem.enqueue(hang)
        # Threads enough for both stuck attempts and the fine job.
        workers(1, concurrency=4)
        dead = sem.wait_for_state(job_id, "dead", timeout=30)
        assert dead.attempts == 2
        assert [e["type"] for e in dead.errors] == ["SessionLostError", "SessionLostError"]
        fine_id = sem.enqueue(fine)
        sem.wait_for_state(fine_id, "completed")
    finally:
        release.set()
    assert calls.counts == {"hang": 2, "fine": 1}
    # The late returns change nothing: their sessions are gone, the attempts counted.
    assert sem.job(job_id).attempts == 2


def test_a_sync_job_with_a_timeout_starts_only_once_its_watch_waits_on_its_row(
    sem: Sem, workers: StartWorkers
) -> None:
    """The watch must queue on the row lock before the handler can hang: a session ended
    before the watch waits frees the row to a claim, and the attempt goes uncounted."""
    waiting: list[int] = []

    @sem.app.task(name="watched", transactional=True, timeout=30)
    def watched(conn: psycopg.Connection[Any]) -> None:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))"
        ).fetchone()
        assert row is not None
        waiting.append(row[0])

    job_id = sem.enqueue(watched)
    workers(1)
    sem.wait_for_state(job_id, "completed")
    assert waiting == [1]


def test_skiplock_retry_in_transactional_mode_at_an_impossible_time_is_recorded(
    sem: Sem, workers: StartWorkers
) -> None:
    @sem.app.task(name="never", transactional=True, max_attempts=1)
    def never(conn: psycopg.Connection[Any]) -> None:
        raise skiplock.Retry(after=float("nan"))

    job_id = sem.enqueue(never)
    workers(1)
    dead = sem.wait_for_state(job_id, "dead")
    assert dead.errors[-1]["type"] == "OutcomeNotStorableError"
    assert dead.errors[-1]["message"].startswith("Retry(after=nan)")


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_handler_that_returns_with_its_transaction_aborted_uses_its_attempts(
    sem: Sem, workers: StartWorkers, flavour: str
) -> None:
    """It swallowed a database error and returned: its savepoint cannot be released.
    The job fails (its attempt counted in the batch's transaction), the batch goes on."""
    calls = Calls()

    if flavour == "sync":

        @sem.app.task(name="swallow", transactional=True, max_attempts=2, retry=NO_RETRY_DELAY)
        def swallow(conn: psycopg.Connection[Any]) -> str:
            calls.record("swallow")
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                conn.execute("SELECT 1 / 0")
            return "looks fine"

        @sem.app.task(name="good", transactional=True)
        def good(conn: psycopg.Connection[Any], n: int) -> int:
            calls.record(("good", n))
            return n

    else:

        @sem.app.task(name="swallow", transactional=True, max_attempts=2, retry=NO_RETRY_DELAY)
        async def swallow(conn: psycopg.AsyncConnection[Any]) -> str:
            calls.record("swallow")
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                await conn.execute("SELECT 1 / 0")
            return "looks fine"

        @sem.app.task(name="good", transactional=True)
        async def good(conn: psycopg.AsyncConnection[Any], n: int) -> int:
            calls.record(("good", n))
            return n

    bad_id = sem.enqueue(swallow)
    good_ids = [sem.enqueue(good, n=n) for n in range(GOOD_JOBS)]
    workers(1)

    dead = sem.wait_for_state(bad_id, "dead")
    assert dead.attempts == 2
    assert [e["type"] for e in dead.errors] == ["InFailedSqlTransaction"] * 2, dead.errors
    sem.wait_for_all(good_ids, "completed")
    expected: dict[Any, int] = {"swallow": 2, **{("good", n): 1 for n in range(GOOD_JOBS)}}
    assert calls.counts == expected
