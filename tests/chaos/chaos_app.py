"""Tasks for the chaos suite, run by real worker processes (``tests.chaos.chaos_app:app``).

Every chaos handler records each execution in ``chaos_executions`` (job, attempt, worker
pid, task, started, finished) through a connection of its own: one per worker process
for the sync handlers and one for the async ones, opened on first use and opened again
when the chaos breaks it. The record survives whatever happens to the job afterwards, so
the tests compute who ran what, and whose outcome was accepted, instead of assuming it.

``hostile.*`` tasks take the rows the hostile-input tests write, by hand or through the
client; they record nothing.

The database is the worker's ``--database-url``; the test creates the table
(``EXECUTIONS_TABLE``) before it starts any worker.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

import psycopg

import skiplock
from skiplock.worker.keepalives import with_keepalives

app = skiplock.App(schema="skiplock")

QUEUE = "chaos"
HOSTILE_QUEUE = "hostile"

ASYNC_TASK = "chaos.async"
SYNC_TASK = "chaos.sync"
DOOMED_TASK = "chaos.doomed"
# Chaos may rescue a job many times; it must never run out of attempts because of that.
MAX_ATTEMPTS = 50

EXECUTIONS_TABLE = """
CREATE TABLE IF NOT EXISTS chaos_executions (
    job_id      bigint      NOT NULL,
    attempt     integer     NOT NULL,
    pid         integer     NOT NULL,
    task        text        NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz,
    -- A write retried after its connection died may have committed the first time.
    PRIMARY KEY (job_id, attempt, pid)
)
"""

# The times are the handler's own (the same host's clock as the test's): a record that
# waits out an outage is written late, but says when the handler really started.
_START = """
INSERT INTO chaos_executions (job_id, attempt, pid, task, started_at)
VALUES (%s, %s, %s, %s, %s)
ON CONFLICT DO NOTHING
"""
_FINISH = """
UPDATE chaos_executions SET finished_at = %s
WHERE job_id = %s AND attempt = %s AND pid = %s AND finished_at IS NULL
"""

# How long a record is retried while the database is away (a restart, say) before the
# handler gives up; well past any outage the suite causes.
RECORD_PATIENCE = 60.0
RECORD_BACKOFF_CAP = 0.5
# A recorder's connection fails within about this many seconds of its peer going silent,
# as the worker's own do (tcp_user_timeout and keepalives): without them, a write whose
# answer was lost in a cut link waits for ever once the server has dropped the session
# (the kernel aborts it without a word), and the handler with it.
RECORD_SILENCE = 4.0


def _recorder_url() -> str:
    return with_keepalives(app.database_url, RECORD_SILENCE)


class RecorderUnavailableError(Exception):
    """The execution could not be recorded within RECORD_PATIENCE."""


class DoomedError(Exception):
    """Raised by every attempt of chaos.doomed: those jobs are designed to end dead."""


def _backoff(failures: int) -> float:
    return float(min(0.02 * 2**failures, RECORD_BACKOFF_CAP))


class SyncRecorder:
    """One autocommit connection shared by the worker's handler threads.

    Writes hold the lock for the whole statement, so a connection is only ever closed
    by the thread that saw it fail and never while another thread uses it.
    """

    def __init__(self) -> None:
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def execute(self, statement: str, params: tuple[Any, ...]) -> None:
        deadline = time.monotonic() + RECORD_PATIENCE
        failures = 0
        while True:
            with self._lock:
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = psycopg.connect(
                            _recorder_url(), autocommit=True, connect_timeout=5
                        )
                    self._conn.execute(statement, params)
                    return
                except psycopg.OperationalError as exc:
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                    failure: Exception = exc
            failures += 1
            if time.monotonic() > deadline:
                raise RecorderUnavailableError(str(failure)) from failure
            time.sleep(_backoff(failures))


class AsyncRecorder:
    """The async twin: one connection for the handlers on the worker's event loop.

    A write runs shielded, so a handler cancelled mid-write (lost lease, shutdown) never
    leaves the shared connection half-way through a statement.
    """

    def __init__(self) -> None:
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock: asyncio.Lock | None = None

    async def execute(self, statement: str, params: tuple[Any, ...]) -> None:
        await asyncio.shield(self._execute(statement, params))

    async def _execute(self, statement: str, params: tuple[Any, ...]) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        deadline = time.monotonic() + RECORD_PATIENCE
        failures = 0
        while True:
            async with self._lock:
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = await psycopg.AsyncConnection.connect(
                            _recorder_url(), autocommit=True, connect_timeout=5
                        )
                    await self._conn.execute(statement, params)
                    return
                except psycopg.OperationalError as exc:
                    if self._conn is not None:
                        await self._conn.close()
                        self._conn = None
                    failure: Exception = exc
            failures += 1
            if time.monotonic() > deadline:
                raise RecorderUnavailableError(str(failure)) from failure
            await asyncio.sleep(_backoff(failures))


_sync_recorder = SyncRecorder()
_async_recorder = AsyncRecorder()


def _now() -> datetime:
    return datetime.now(UTC)


def _sync_run(task: str, ms: float) -> dict[str, int]:
    job = skiplock.current_job()
    pid = os.getpid()
    _sync_recorder.execute(_START, (job.id, job.attempts, pid, task, _now()))
    time.sleep(ms / 1000)
    _sync_recorder.execute(_FINISH, (_now(), job.id, job.attempts, pid))
    return {"pid": pid, "attempt": job.attempts}


@app.task(name=ASYNC_TASK, queue=QUEUE, max_attempts=MAX_ATTEMPTS)
async def work_async(ms: float) -> dict[str, int]:
    """Async work on the worker's event loop; its attempt is the claim's fencing token."""
    job = skiplock.current_job()
    pid = os.getpid()
    await _async_recorder.execute(_START, (job.id, job.attempts, pid, ASYNC_TASK, _now()))
    await asyncio.sleep(ms / 1000)
    await _async_recorder.execute(_FINISH, (_now(), job.id, job.attempts, pid))
    return {"pid": pid, "attempt": job.attempts}


@app.task(name=SYNC_TASK, queue=QUEUE, max_attempts=MAX_ATTEMPTS)
def work_sync(ms: float) -> dict[str, int]:
    """Sync work in the worker's thread pool: a cancelled attempt's thread runs on to the
    end, so its late completion reaches the completer's fence."""
    return _sync_run(SYNC_TASK, ms)


@app.task(
    name=DOOMED_TASK,
    queue=QUEUE,
    max_attempts=2,
    retry=skiplock.RetryPolicy(base=0.2, cap=0.5),
)
def doomed(ms: int) -> None:
    """Fails every attempt: these jobs must end dead, never lost and never completed."""
    _sync_run(DOOMED_TASK, ms)
    raise DoomedError("designed to fail")


# -- hostile input ------------------------------------------------------------------------


@app.task(name="hostile.strict", queue=HOSTILE_QUEUE, max_attempts=1)
def strict(order_id: int, note: str = "") -> dict[str, Any]:
    """A handler with a fixed signature, whose own code trips over arguments of the
    wrong type, as real handlers do."""
    return {"order_id": order_id + 1, "note": note.upper()}


@app.task(name="hostile.echo", queue=HOSTILE_QUEUE, max_attempts=1)
def echo(**kwargs: Any) -> dict[str, Any]:
    """Takes anything and returns it, so a payload's round trip through a worker shows."""
    return kwargs
