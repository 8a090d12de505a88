"""Heartbeats: this worker's registration, its leases and its jobs' progress.

On a connection of its own (not the pool) and in a loop of its own, so that no other duty
ever delays it: a leader statement waiting on a user's row lock, a busy pool, a slow
claim. A heartbeat that does not arrive lets the lease run out, and the job runs twice.
Its statements have bounds of their own (timeouts.heartbeat_bounds): one that waits too
long is given up and sent again at the next beat, still well inside the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

import psycopg

from skiplock.completer import fenced_batch
from skiplock.sql import complete, maintenance, render
from skiplock.worker.liveness import session_kwargs
from skiplock.worker.supervisor import PeriodicService
from skiplock.worker.timeouts import heartbeat_bounds

log = logging.getLogger("skiplock.worker.heartbeat")

# The lease-mode jobs this worker runs: id -> (attempt, the task running it). Shared with
# the worker, which adds and removes them.
Leased = dict[int, tuple[int, "asyncio.Task[None]"]]


class Heartbeat(PeriodicService):
    """Every ``every`` seconds: touch the registration and extend the leases. Every
    ``tick``: write the progress handlers reported since."""

    name = "heartbeat"
    log = log

    def __init__(
        self,
        database_url: str,
        schema: str,
        worker_id: UUID,
        *,
        lease_seconds: float,
        every: float,
        tick: float,
        registration: Callable[[], dict[str, Any]],
        leased: Leased,
        take_progress: Callable[[], dict[int, tuple[int, str]]],
        request_cancel: Callable[[int], None],
        on_lost: Callable[[int, int, asyncio.Task[None]], None],
        on_connect: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]] | None = None,
        on_beat: Callable[[float], None] | None = None,
        connect_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._url = database_url
        # The bounds go in ``options``; behind a pooler none, and no prepared statements
        # (pooler.py): the worker passes its own.
        self._connect_kwargs = (
            {"options": heartbeat_bounds(every).options()}
            if connect_kwargs is None
            else connect_kwargs
        )
        self._worker_id = worker_id
        self._lease_seconds = lease_seconds
        self.every = every
        self._tick = tick
        self._registration = registration
        self._leased = leased
        self._take_progress = take_progress
        self._request_cancel = request_cancel
        self._on_lost = on_lost
        self._on_connect = on_connect
        self._on_beat = on_beat
        self._touch = render(maintenance.WORKER_TOUCH, schema)
        self._extend = render(maintenance.JOB_EXTEND_LEASES_SKIP_LOCKED, schema)
        self._progress = render(complete.JOB_PROGRESS_SET, schema)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._next_beat = 0.0
        self.beats = 0
        # Jobs whose lease the last beats could not extend (their row locked elsewhere):
        # warned about once each.
        self._locked: set[int] = set()

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def pause(self) -> None:
        await asyncio.sleep(self._tick)

    def failed(self, exc: Exception) -> None:
        # Start over on a fresh connection: a timed-out statement leaves this one usable,
        # but a lost one does not, and telling them apart is not worth the risk.
        conn, self._conn = self._conn, None
        if conn is not None:
            asyncio.get_running_loop().create_task(conn.close())

    async def run_once(self) -> None:
        """A beat when one is due, and the progress reported since the last tick."""
        conn = await self._connection()
        now = asyncio.get_running_loop().time()
        if now >= self._next_beat:
            await self.beat(conn)
            self._next_beat = now + self.every
        await self._write_progress(conn)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self._url,
                autocommit=True,
                connect_timeout=10,
                **self._connect_kwargs,
                **session_kwargs("heartbeat", self._worker_id),
            )
            if self._on_connect is not None:
                await self._on_connect(self._conn)  # the liveness lock (liveness.py)
        return self._conn

    async def beat(self, conn: psycopg.AsyncConnection[Any] | None = None) -> None:
        """Touch the registration and extend this worker's leases; stop the jobs whose
        lease was lost, and cancel those whose cancellation was asked for."""
        if conn is None:
            conn = await self._connection()
        await conn.execute(self._touch, self._registration())
        self.beats += 1
        # The leases asked about, and when: what the answer confirms holds from then on.
        asked_at = time.monotonic()
        if not self._leased:
            self._locked.clear()
            self._beaten(asked_at)
            return
        held = dict(self._leased)
        cur = await conn.execute(
            self._extend,
            {
                **fenced_batch({job_id: {"attempt": a} for job_id, (a, _) in held.items()}),
                "worker_id": self._worker_id,
                "lease_seconds": self._lease_seconds,
            },
        )
        rows = await cur.fetchall()
        kept = {row[0] for row in rows}
        for job_id, asked, extended in rows:
            if asked:
                self._request_cancel(job_id)  # its notification may have been missed
            if not extended and job_id not in self._locked:
                log.warning(
                    "job %s: its row is locked by another transaction; its lease is "
                    "extended once the lock is released",
                    job_id,
                )
            elif extended:
                self._locked.discard(job_id)
            if not extended:
                self._locked.add(job_id)
        for job_id, (attempt, task) in held.items():
            if job_id in kept or self._leased.get(job_id, (None,))[0] != attempt:
                continue
            # Lost between heartbeats, or finished and already flushed: only the former
            # is still leased here with no outcome pending.
            if task.done():
                continue
            self._on_lost(job_id, attempt, task)
        self._beaten(asked_at)

    def _beaten(self, asked_at: float) -> None:
        """Every lease held at ``asked_at`` is confirmed, or its loss acted on."""
        if self._on_beat is not None:
            self._on_beat(asked_at)

    async def _write_progress(self, conn: psycopg.AsyncConnection[Any]) -> None:
        pending = self._take_progress()
        for job_id, (attempt, encoded) in pending.items():
            await conn.execute(
                self._progress,
                {
                    "id": job_id,
                    "attempt": attempt,
                    "worker_id": self._worker_id,
                    "progress": encoded,
                },
            )
