"""A stop keeps a transactional batch's finished work (issue 20, item 6), with real workers.

A stop asked while a batch runs starts no further job of it; the jobs that finished
commit, and those not started go back untouched (their row locks were the claim) with
their attempts as they were. A job still running at the shutdown deadline is cut short:
its writes roll back, its attempt is not counted, and it gets the WorkerShutdown note
that lease mode gives; the jobs finished before it commit all the same. A sync handler
cannot be stopped: what it writes once cut short never commits.

Starts are recorded on connections of their own (they survive any rollback); what the
jobs write in their own transactions goes to ``marks``, which shows what committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from semantics.conftest import Sem, StartWorkers

pytestmark = pytest.mark.timeout(90)

# The figures (jobs of 2 s, a 5 s shutdown timeout) scaled down by 2.
JOB_SECONDS = 1.0
SHUTDOWN_TIMEOUT = 2.5


class Tables:
    """``starts`` (written on a connection of its own) and ``marks`` (written in the job's
    transaction), in the test's schema."""

    def __init__(self, sem: Sem) -> None:
        self.sem = sem
        self.starts_table = sql.Identifier(sem.schema, "starts")
        self.marks_table = sql.Identifier(sem.schema, "marks")
        with sem.connect() as conn:
            for table in (self.starts_table, self.marks_table):
                conn.execute(sql.SQL("CREATE TABLE {} (job_id bigint, what text)").format(table))
        self.insert_start = sql.SQL("INSERT INTO {} VALUES (%s, 'start')").format(self.starts_table)
        self.insert_mark = sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(self.marks_table)

    def record_start(self, job_id: int) -> None:
        with psycopg.connect(self.sem.url, autocommit=True) as own:
            own.execute(self.insert_start, (job_id,))

    async def record_start_async(self, job_id: int) -> None:
        async with await psycopg.AsyncConnection.connect(self.sem.url, autocommit=True) as own:
            await own.execute(self.insert_start, (job_id,))

    def _rows(self, table: sql.Identifier) -> list[tuple[int, str]]:
        with self.sem.connect() as conn:
            rows = conn.execute(sql.SQL("SELECT job_id, what FROM {} ORDER BY 1, 2").format(table))
            return [(int(job_id), str(what)) for job_id, what in rows]

    def starts(self) -> list[int]:
        return [job_id for job_id, _ in self._rows(self.starts_table)]

    def marks(self) -> list[tuple[int, str]]:
        return self._rows(self.marks_table)


def _picture(sem: Sem, tables: Tables, ids: list[int]) -> dict[str, Any]:
    """What the database says of the batch: who started, what committed, what is left."""
    history = sem.execute(
        "SELECT id, state, attempts FROM {history} WHERE id = ANY(%s) ORDER BY id", (ids,)
    )
    live = sem.execute(
        "SELECT id, state, attempts, errors FROM {jobs} WHERE id = ANY(%s) ORDER BY id", (ids,)
    )
    return {
        "started": tables.starts(),
        "history": [(int(i), str(s), int(a)) for i, s, a in history],
        "marks": tables.marks(),
        "left": [
            (int(i), str(s), int(a), [str(e.get("type")) for e in errors])
            for i, s, a, errors in live
        ],
    }


def _current_id() -> int:
    job = skiplock.current_job()
    assert job is not None
    return int(job.id)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_stop_during_a_batch_commits_the_finished_job_and_starts_no_other(
    sem: Sem, workers: StartWorkers, flavour: str
) -> None:
    """The issue's scenario: three jobs of one batch, the stop asked as the first starts.
    Before: the batch ran on (jobs 2 and 3 started after the stop) and, the deadline
    reached during job 3, everything rolled back and ran again."""
    tables = Tables(sem)
    first_started = threading.Event()

    if flavour == "sync":

        @sem.app.task(name="slow", transactional=True)
        def slow(conn: psycopg.Connection[Any]) -> str:
            job_id = _current_id()
            tables.record_start(job_id)
            first_started.set()
            time.sleep(JOB_SECONDS)
            conn.execute(tables.insert_mark, (job_id, "done"))
            return "done"

    else:

        @sem.app.task(name="slow", transactional=True)
        async def slow(conn: psycopg.AsyncConnection[Any]) -> str:
            job_id = _current_id()
            await tables.record_start_async(job_id)
            first_started.set()
            await asyncio.sleep(JOB_SECONDS)
            await conn.execute(tables.insert_mark, (job_id, "done"))
            return "done"

    ids = [int(sem.enqueue(slow)) for _ in range(3)]
    (worker,) = workers(1, concurrency=1, shutdown_timeout=SHUTDOWN_TIMEOUT)
    assert first_started.wait(20), "the first job did not start"
    worker.request_stop()
    worker.join()

    first, second, third = ids
    assert _picture(sem, tables, ids) == {
        "started": [first],
        "history": [(first, "completed", 1)],
        "marks": [(first, "done")],
        "left": [(second, "available", 0, []), (third, "available", 0, [])],
    }

    # The next worker runs the two handed back, and the first job not again.
    workers(1, concurrency=1)
    sem.wait_for_all(ids, "completed")
    assert _picture(sem, tables, ids) == {
        "started": ids,
        "history": [(job_id, "completed", 1) for job_id in ids],
        "marks": [(job_id, "done") for job_id in ids],
        "left": [],
    }


@pytest.mark.parametrize("flavour", ["sync", "sync with a timeout", "sync in a statement", "async"])
def test_a_job_running_at_the_deadline_is_cut_short_and_the_finished_one_commits(
    sem: Sem, workers: StartWorkers, flavour: str
) -> None:
    """A batch of quick, stuck, after: the stop asked while stuck runs, and stuck still
    running at the deadline. The quick job's outcome commits; stuck's writes roll back
    and its attempt is not counted; after never starts. A sync handler's thread runs on:
    what it writes after the cut must not commit either."""
    tables = Tables(sem)
    stuck_started = threading.Event()
    release = threading.Event()
    stuck_returned = threading.Event()

    if flavour.startswith("sync"):

        def done(conn: psycopg.Connection[Any]) -> str:
            job_id = _current_id()
            tables.record_start(job_id)
            conn.execute(tables.insert_mark, (job_id, "done"))
            return "done"

        def hang(conn: psycopg.Connection[Any]) -> str:
            job_id = _current_id()
            try:
                tables.record_start(job_id)
                conn.execute(tables.insert_mark, (job_id, "before the cut"))
                stuck_started.set()
                if flavour == "sync in a statement":
                    # Ended by the cut's cancel request; the handler goes on regardless.
                    with contextlib.suppress(psycopg.errors.QueryCanceled):
                        conn.execute("SELECT pg_sleep(60)")
                else:
                    release.wait(60)  # outside SQL, as a thread that cannot be stopped
                conn.execute(tables.insert_mark, (job_id, "after the cut"))
                return "late"
            finally:
                stuck_returned.set()

    else:

        async def done(conn: psycopg.AsyncConnection[Any]) -> str:  # type: ignore[misc]
            job_id = _current_id()
            await tables.record_start_async(job_id)
            await conn.execute(tables.insert_mark, (job_id, "done"))
            return "done"

        async def hang(conn: psycopg.AsyncConnection[Any]) -> str:  # type: ignore[misc]
            job_id = _current_id()
            try:
                await tables.record_start_async(job_id)
                await conn.execute(tables.insert_mark, (job_id, "before the cut"))
                stuck_started.set()
                while not release.is_set():
                    await asyncio.sleep(0.01)
                await conn.execute(tables.insert_mark, (job_id, "after the cut"))
                return "late"
            finally:
                stuck_returned.set()

    # One kind of handler, so that the three share one batch.
    timeout = 60 if flavour == "sync with a timeout" else None
    quick = sem.app.task(name="quick", transactional=True)(done)
    stuck = sem.app.task(name="stuck", transactional=True, timeout=timeout)(hang)
    after = sem.app.task(name="after", transactional=True)(done)

    ids = [int(sem.enqueue(task)) for task in (quick, stuck, after)]
    quick_id, stuck_id, after_id = ids
    try:
        (worker,) = workers(1, concurrency=1, shutdown_timeout=0.5)
        assert stuck_started.wait(20), "the stuck job did not start"
        worker.request_stop()
        worker.join()
        picture = _picture(sem, tables, ids)
    finally:
        release.set()
    assert picture == {
        "started": [quick_id, stuck_id],
        "history": [(quick_id, "completed", 1)],
        "marks": [(quick_id, "done")],
        "left": [
            (stuck_id, "available", 0, ["WorkerShutdown"]),
            (after_id, "available", 0, []),
        ],
    }
    # Let the cut handler end (a sync one returns now): nothing it writes commits.
    assert stuck_returned.wait(20)
    assert _picture(sem, tables, ids) == picture
