"""Telling the database what became of jobs claimed ahead (a prefetching worker only):
started, or given back unstarted.

A job a prefetching worker claims is marked claimed ahead (sql/claim.py, JOB_CLAIM_AHEAD),
and rescue gives back the attempt of a marked job whose worker died: it never started.
Once a job starts, this service clears the mark, in one statement per batch, a moment
later and only if the job is still running then: most jobs finish first, and their
outcome is then the only write. Until the mark is cleared a started job that loses its
worker is given its attempt back (once in a row: see sql/maintenance.py); decision 015
weighs that against a write before every start. A job that waited too long for a slot,
or whose worker is stopping, is given back unstarted instead (``give_back``, decision 018).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any
from uuid import UUID

from psycopg_pool import AsyncConnectionPool

from skiplock.completer import fenced_batch
from skiplock.config import notify_channel, results_notice
from skiplock.sql import claim, complete, render
from skiplock.worker.supervisor import PeriodicService

log = logging.getLogger("skiplock.worker.starts")

# How long after its start a job still running has its start recorded. Shorter means
# fewer started jobs given back after a crash, at the price of a write for more jobs.
RECORD_AFTER_SECONDS = 0.05
# Why a job claimed ahead went back unstarted when its worker stopped (its errors say so,
# as a released job's do).
STOPPED_NOTE = "worker stopped before the job started; the attempt is not counted"


@dataclass(eq=False)
class StartRecorder(PeriodicService):
    name = "starts"
    log = log

    pool: AsyncConnectionPool[Any]
    schema: InitVar[str]
    worker_id: UUID
    attempt_of: Callable[[int], int | None]
    _: KW_ONLY
    after: float = RECORD_AFTER_SECONDS
    _statement: str = field(init=False)
    _still_claimed: str = field(init=False)
    _give_back: str = field(init=False)
    _start_keyed: str = field(init=False)
    _channel: str = field(init=False)
    _results_notice: tuple[str, dict[str, str]] = field(init=False)
    _started: dict[int, int] = field(init=False, default_factory=dict)
    _noted: asyncio.Event = field(init=False, default_factory=asyncio.Event)

    def __post_init__(self, schema: str) -> None:
        self._statement = render(claim.JOB_MARK_STARTED, schema)
        self._still_claimed = render(claim.JOB_STILL_CLAIMED, schema)
        self._give_back = render(complete.JOB_GIVE_BACK_UNSTARTED, schema)
        self._start_keyed = render(claim.JOB_START_KEYED, schema)
        self._channel = notify_channel(schema)
        self._results_notice = results_notice(schema)

    def note(self, job_id: int, attempt: int) -> None:
        """The job's attempt has started (its handler is being called now)."""
        self._started[job_id] = attempt
        self._noted.set()

    async def still_claimed(self, job_id: int, attempt: int) -> bool:
        """Whether the job's attempt is still this worker's, read now."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._still_claimed,
                {"id": job_id, "attempt": attempt, "worker_id": self.worker_id},
            )
            return await cur.fetchone() is not None

    async def start_keyed(self, job_id: int, attempt: int) -> bool:
        """Record now that a job holding a queued-scope key starts, releasing the key;
        False if the row is not this worker's attempt (or was locked by another
        transaction)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._start_keyed,
                {"id": job_id, "attempt": attempt, "worker_id": self.worker_id},
            )
            return await cur.fetchone() is not None

    async def give_back(self, jobs: dict[int, int], *, stopping: bool = False) -> int:
        """Give back jobs (id -> attempt) this worker claimed ahead and never started,
        with a note if the worker is ``stopping``; returns how many went back to their
        queues (the others had been given back already, or were cancelled as asked)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._give_back,
                {
                    **fenced_batch({job_id: {"attempt": a} for job_id, a in jobs.items()}),
                    "worker_id": self.worker_id,
                    "channel": self._channel,
                    "note": STOPPED_NOTE if stopping else None,
                },
            )
            rows = await cur.fetchall()
            if any(row[0] is None for row in rows):  # some ended cancelled: wake waiters
                await conn.execute(*self._results_notice)
        return sum(int(row[1]) for row in rows if row[0] is not None)

    async def pause(self) -> None:
        await self._noted.wait()
        await asyncio.sleep(self.after)

    async def run_once(self) -> None:
        self._noted.clear()
        started, self._started = self._started, {}
        # Finished ones are left out: their outcome is written (or about to be).
        running = {
            job_id: {"attempt": attempt}
            for job_id, attempt in started.items()
            if self.attempt_of(job_id) == attempt
        }
        if not running:
            return
        marked: set[int] = set()
        try:
            async with self.pool.connection() as conn:
                cur = await conn.execute(
                    self._statement, {**fenced_batch(running), "worker_id": self.worker_id}
                )
                marked = {int(row[0]) for row in await cur.fetchall()}
        finally:
            # Not written (the statement failed, or another transaction held the row):
            # again with the next batch, unless the job has finished by then.
            for job_id, entry in running.items():
                if job_id not in marked:
                    self._started.setdefault(job_id, entry["attempt"])
                    self._noted.set()
