"""Tasks for the crash tests, run by real worker processes (``tests.crash_app:app``).

Every handler records its start in ``crash_executions`` through a connection of its own
(autocommit), so the record survives whatever happens to the job afterwards, including a
transactional job's rollback when its process is killed. A handler asked to ``hold`` then
waits until the test puts a row for its (job, attempt) in ``crash_releases``: that is the
window in which the test kills, stops or signals the worker. Finishing sets
``finished_at``. The test creates and drops these tables (see ``test_crash.py``).

The database is ``SKIPLOCK_DATABASE_URL``, which the test sets for the worker process.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg

import skiplock
from skiplock.worker import producer

app = skiplock.App(schema="skiplock")

# The tests kill or stop a worker while jobs it claimed ahead wait at its gate; a worker
# gives such jobs back after a moment (decision 018), which here would end the window
# before the test acts. The give-back has tests of its own (tests/test_claim_ahead.py).
producer.GIVE_BACK_AFTER = 3600.0

QUEUE = "crash"
# A handler never waits longer than this for its release: a test that failed half-way
# must not leave a worker process blocked forever.
RELEASE_PATIENCE = 60.0
RELEASE_POLL = 0.02

_RECORD_START = """
INSERT INTO crash_executions (job_id, attempt, pid, task) VALUES (%s, %s, %s, %s)
"""
_RECORD_FINISH = """
UPDATE crash_executions SET finished_at = clock_timestamp()
WHERE job_id = %s AND attempt = %s AND pid = %s
"""
_RELEASED = "SELECT 1 FROM crash_releases WHERE job_id = %s AND attempt = %s"
_RECORD_EFFECT = "INSERT INTO crash_effects (job_id, pid) VALUES (%s, %s)"


class NeverReleasedError(Exception):
    """The test never released this attempt (it failed, or forgot)."""


def _record_start(own: psycopg.Connection[Any], task: str, attempt: int) -> int:
    job_id = skiplock.current_job().id
    own.execute(_RECORD_START, (job_id, attempt, os.getpid(), task))
    return job_id


def _wait_for_release(own: psycopg.Connection[Any], job_id: int, attempt: int) -> None:
    deadline = time.monotonic() + RELEASE_PATIENCE
    while own.execute(_RELEASED, (job_id, attempt)).fetchone() is None:
        if time.monotonic() > deadline:
            raise NeverReleasedError(f"job {job_id} attempt {attempt} was never released")
        time.sleep(RELEASE_POLL)


def _run_sync(task: str, attempt: int, hold: bool) -> dict[str, int]:
    with psycopg.connect(app.database_url, autocommit=True) as own:
        job_id = _record_start(own, task, attempt)
        if hold:
            _wait_for_release(own, job_id, attempt)
        own.execute(_RECORD_FINISH, (job_id, attempt, os.getpid()))
    return {"pid": os.getpid(), "attempt": attempt}


@app.task(name="crash.leased", queue=QUEUE, max_attempts=5)
def leased(hold: bool = False) -> dict[str, int]:
    """Lease mode, in the worker's thread pool: its attempt is the claim's fencing token."""
    return _run_sync("crash.leased", skiplock.current_job().attempts, hold)


@app.task(name="crash.transactional", queue=QUEUE, transactional=True)
def transactional(conn: psycopg.Connection[Any], hold: bool = False) -> dict[str, int]:
    """Transactional mode (sync): writes an effect in the job's own transaction first, so
    a test can see it vanish with a killed attempt and appear once with the completed one."""
    conn.execute(_RECORD_EFFECT, (skiplock.current_job().id, os.getpid()))
    # attempts counts earlier attempts only: a rolled-back attempt leaves it unchanged.
    return _run_sync("crash.transactional", skiplock.current_job().attempts + 1, hold)


async def _run_async(task: str, attempt: int, hold: bool) -> dict[str, int]:
    job_id, pid = skiplock.current_job().id, os.getpid()
    async with await psycopg.AsyncConnection.connect(app.database_url, autocommit=True) as own:
        await own.execute(_RECORD_START, (job_id, attempt, pid, task))
        deadline = time.monotonic() + RELEASE_PATIENCE
        while hold:
            cur = await own.execute(_RELEASED, (job_id, attempt))
            if await cur.fetchone() is not None:
                break
            if time.monotonic() > deadline:
                raise NeverReleasedError(f"job {job_id} attempt {attempt} was never released")
            await asyncio.sleep(RELEASE_POLL)
        await own.execute(_RECORD_FINISH, (job_id, attempt, pid))
    return {"pid": pid, "attempt": attempt}


@app.task(name="crash.leased_async", queue=QUEUE, max_attempts=5)
async def leased_async(hold: bool = False) -> dict[str, int]:
    """Lease mode on the worker's event loop: unlike a thread, it can be cancelled."""
    return await _run_async("crash.leased_async", skiplock.current_job().attempts, hold)


@app.task(name="crash.transactional_async", queue=QUEUE, transactional=True)
async def transactional_async(
    conn: psycopg.AsyncConnection[Any], hold: bool = False
) -> dict[str, int]:
    """Async twin of ``transactional``."""
    await conn.execute(_RECORD_EFFECT, (skiplock.current_job().id, os.getpid()))
    return await _run_async("crash.transactional_async", skiplock.current_job().attempts + 1, hold)


@app.task(name="crash.stepped", queue=QUEUE, max_attempts=5)
def stepped() -> dict[str, int]:
    """Lease mode with durable steps: 'charge' writes its effect (through a connection of
    its own, so the effect outlives a killed process), then 'hold' waits for the test's
    release. Killed in 'hold', the next attempt must not charge again."""
    job_id, attempt = skiplock.current_job().id, skiplock.current_job().attempts
    with psycopg.connect(app.database_url, autocommit=True) as own:
        _record_start(own, "crash.stepped", attempt)

        def charge() -> int:
            own.execute(_RECORD_EFFECT, (job_id, os.getpid()))
            return os.getpid()

        charged_by = skiplock.step("charge", charge)
        skiplock.step("hold", _wait_for_release, own, job_id, attempt)
        own.execute(_RECORD_FINISH, (job_id, attempt, os.getpid()))
    return {"charged_by": charged_by, "attempt": attempt}
