"""Heartbeats: this worker's registration, its leases, its jobs' progress, and what the
database says it runs against what it runs.

On a connection of its own (not the pool) and in a loop of its own, so that no other duty
ever delays it: a leader statement waiting on a user's row lock, a busy pool, a slow
claim. A heartbeat that does not arrive lets the lease run out, and the job runs twice.
Its statements have bounds of their own (timeouts.heartbeat_bounds): one that waits too
long is given up and sent again at the next beat, still well inside the lease.

Each beat also gives back, at once, the jobs running under this worker in the database
that it does not run (a claim's answer or an outcome lost with a connection, or in an
asynchronous failover). Its worker alive, no rescue would take them until their lease
ran out, and a lease can be long (docs/failover.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import KW_ONLY, InitVar, dataclass, field
from datetime import datetime
from typing import Any, TypeVar
from uuid import UUID

import psycopg

from skiplock.completer import fenced_batch
from skiplock.config import notify_channel, results_notice
from skiplock.sql import complete, maintenance, render
from skiplock.waiting import wait_event
from skiplock.worker.liveness import session_kwargs
from skiplock.worker.running import RunningJob, RunningJobs
from skiplock.worker.supervisor import PeriodicService, describe
from skiplock.worker.timeouts import heartbeat_bounds

log = logging.getLogger("skiplock.worker.heartbeat")

# Readings of the database's clock kept, to find one older than the oldest claim in flight.
CLOCK_READINGS = 8

A = TypeVar("A")
R = TypeVar("R")


class ClaimsInFlight:
    """The claims this worker has sent whose answers it has not read yet, by when each
    was sent (monotonic seconds). What they claimed is running under this worker in the
    database and not yet registered (RunningJobs): the heartbeat must not give it back."""

    def __init__(self) -> None:
        self._sent: dict[int, float] = {}
        self._count = 0
        self._returned = asyncio.Event()

    def track(self, fetch: Callable[[A], Awaitable[R]]) -> Callable[[A], Awaitable[R]]:
        """``fetch`` (a producer's claim), counted as in flight from its call until it
        returns (its jobs are registered by then) or raises (its answer is lost)."""

        async def tracked(arg: A) -> R:
            self._count += 1
            key = self._count
            self._sent[key] = time.monotonic()
            try:
                return await fetch(arg)
            finally:
                del self._sent[key]
                self._returned.set()

        return tracked

    async def returned(self, sent_before: float, timeout: float) -> bool:
        """True once every claim sent before ``sent_before`` has returned (its jobs are
        registered); False if one is still in flight after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while any(sent < sent_before for sent in self._sent.values()):
            self._returned.clear()
            left = deadline - time.monotonic()
            if left <= 0 or not await wait_event(self._returned, left):
                return False
        return True

    def oldest(self) -> float | None:
        """When the oldest claim still in flight was sent; None when none is."""
        return min(self._sent.values(), default=None)


@dataclass(eq=False)
class Heartbeat(PeriodicService):
    """Every ``every`` seconds: touch the registration and extend the leases. Every
    ``tick``: write the progress handlers reported since."""

    name = "heartbeat"
    log = log

    database_url: str
    schema: InitVar[str]
    worker_id: UUID
    _: KW_ONLY
    lease_seconds: float
    every: float
    tick: float
    registration: Callable[[], dict[str, Any]]
    running: RunningJobs
    request_cancel: Callable[[int], None]
    on_lost: Callable[[RunningJob], None]
    on_connect: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]] | None = None
    on_beat: Callable[[float], None] | None = None
    # The bounds go in ``options``; behind a pooler none, and no prepared statements
    # (pooler.py): the worker passes its own.
    connect_kwargs: InitVar[dict[str, Any] | None] = None
    # Reconciliation (run only when ``settling`` is given): the claims in flight, and the
    # jobs not registered whose rows the worker still means to write (outcomes not yet
    # flushed), or None while it must not give anything back (stopping: the drain gives
    # back what it holds, by its own rules).
    claims: InitVar[ClaimsInFlight | None] = None
    settling: Callable[[], Collection[int] | None] | None = None
    _connect_kwargs: dict[str, Any] = field(init=False)
    _claims: ClaimsInFlight = field(init=False)
    _clock: deque[tuple[float, datetime]] = field(init=False)
    # Jobs given back because this worker did not run them, since it started.
    given_back: int = field(init=False, default=0)
    _reconcile_ms: int = field(init=False)
    _reconcile_failed: bool = field(init=False, default=False)
    _conn: psycopg.AsyncConnection[Any] | None = field(init=False, default=None)
    _next_beat: float = field(init=False, default=0.0)
    beats: int = field(init=False, default=0)
    # Jobs whose lease the last beats could not extend (their row locked elsewhere):
    # warned about once each.
    _locked: set[int] = field(init=False, default_factory=set)

    def __post_init__(
        self,
        schema: str,
        connect_kwargs: dict[str, Any] | None,
        claims: ClaimsInFlight | None,
    ) -> None:
        self._connect_kwargs = (
            {"options": heartbeat_bounds(self.every).options()}
            if connect_kwargs is None
            else connect_kwargs
        )
        self._claims = claims if claims is not None else ClaimsInFlight()
        self._clock = deque(maxlen=CLOCK_READINGS)
        self._render(schema)
        self._reconcile_ms = max(int(min(max(self.every / 2, 0.5), 2 * self.every) * 1000), 1)

    def _render(self, schema: str) -> None:
        """The statements of a beat, rendered for ``schema`` once."""
        self._clock_read = render(maintenance.DATABASE_CLOCK_READ, schema)
        self._unknown = render(maintenance.JOB_RUNNING_UNKNOWN, schema)
        self._give_back = render(maintenance.JOB_GIVE_BACK_UNKNOWN, schema)
        self._cancel = render(complete.JOB_CANCEL_MANY_IF_LEASED, schema)
        self._channel = notify_channel(schema)
        self._results_notice = results_notice(schema)
        self._touch = render(maintenance.WORKER_TOUCH, schema)
        self._extend = render(maintenance.JOB_EXTEND_LEASES_SKIP_LOCKED, schema)
        self._progress = render(complete.JOB_PROGRESS_SET, schema)

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
        await asyncio.sleep(self.tick)

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
                self.database_url,
                autocommit=True,
                connect_timeout=10,
                **self._connect_kwargs,
                **session_kwargs("heartbeat", self.worker_id),
            )
            if self.on_connect is not None:
                await self.on_connect(self._conn)  # the liveness lock (liveness.py)
        return self._conn

    async def beat(self, conn: psycopg.AsyncConnection[Any] | None = None) -> None:
        """Touch the registration and extend this worker's leases; stop the jobs whose
        lease was lost, cancel those whose cancellation was asked for, and give back the
        jobs the database says this worker runs and it does not."""
        if conn is None:
            conn = await self._connection()
        await conn.execute(self._touch, self.registration())
        self.beats += 1
        await self._extend_leases(conn)
        if self.settling is None:
            return
        try:
            async with conn.transaction():
                await self._reconcile(conn)
        except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
            # The leases are extended; the comparison is tried again at the next beat.
            log.log(
                logging.DEBUG if self._reconcile_failed else logging.WARNING,
                "could not compare the jobs the database says this worker runs with "
                "those it runs (%s); trying again at the next beat",
                describe(exc),
            )
            self._reconcile_failed = True
        else:
            self._reconcile_failed = False

    async def _extend_leases(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # The leases asked about, and when: what the answer confirms holds from then on.
        asked_at = time.monotonic()
        held = self.running.snapshot()
        if not held:
            self._locked.clear()
            self._beaten(asked_at)
            return
        cur = await conn.execute(
            self._extend,
            {
                **fenced_batch({job_id: {"attempt": e.attempt} for job_id, e in held.items()}),
                "worker_id": self.worker_id,
                "lease_seconds": self.lease_seconds,
            },
        )
        rows = await cur.fetchall()
        kept = {row[0] for row in rows}
        for job_id, asked, extended in rows:
            if asked:
                self.request_cancel(job_id)  # its notification may have been missed
            if not extended and job_id not in self._locked and not _by_handler(held, job_id):
                log.warning(
                    "job %s: its row is locked by another transaction; its lease is "
                    "extended once the lock is released",
                    job_id,
                )
            elif extended:
                self._locked.discard(job_id)
            if not extended:
                self._locked.add(job_id)
        for job_id, entry in held.items():
            if job_id in kept or not entry.held or entry.completed_by_handler:
                continue
            # Lost between heartbeats, or finished and already flushed: only the former
            # is still held here with no outcome pending.
            if entry.task.done():
                continue
            self.on_lost(entry)
        self._beaten(asked_at)

    async def _read_clock(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Read the database's clock: every claim sent after the answer came back claims
        at that time or later (DATABASE_CLOCK_READ)."""
        cur = await conn.execute(self._clock_read, {"statement_timeout": f"{self._reconcile_ms}ms"})
        row = await cur.fetchone()
        if row is not None:
            self._clock.append((time.monotonic(), row[0]))

    def _claimed_before(self, sent: float) -> datetime | None:
        """The latest reading of the database's clock whose answer came back before
        ``sent`` (monotonic seconds): no claim sent since then claimed anything before it."""
        readings = [at for answered, at in self._clock if answered <= sent]
        return readings[-1] if readings else None

    async def _reconcile(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Give back the jobs running under this worker in the database that it does not
        run. Never one a claim still in flight may deliver: only jobs claimed before the
        oldest such claim was sent, on the database's clock. The order of the looks
        matters: a claim's jobs are registered before the claim leaves the claims in
        flight, and a job's outcome is queued before it leaves the registry; so a job is seen
        in one place or another, or its row is no longer this worker's."""
        assert self.settling is not None
        await self._read_clock(conn)
        sent = self._claims.oldest()
        looked_at = time.monotonic()
        known = set(self.running.snapshot())
        settling = self.settling()
        if settling is None:
            return
        known.update(settling)
        before = self._claimed_before(looked_at if sent is None else min(sent, looked_at))
        if before is None:
            return  # a claim older than every reading is in flight: at the next beat
        cur = await conn.execute(
            self._unknown,
            {"worker_id": self.worker_id, "known": sorted(known), "before": before},
        )
        unknown = await cur.fetchall()
        if not unknown:
            return
        cancelled = {int(job_id): int(attempt) for job_id, attempt, asked in unknown if asked}
        strays = {int(job_id): int(attempt) for job_id, attempt, asked in unknown if not asked}
        given = await self._give_back_strays(conn, strays)
        ended = await self._end_cancelled(conn, cancelled)
        if given or ended:
            self.given_back += given + ended
            # Of those found, a row locked elsewhere or changed since is left for later.
            log.warning(
                "the database said this worker ran %s, and it did not (a claim's answer or "
                "an outcome was lost): gave back %d, ended %d cancelled as asked",
                ", ".join(
                    f"job {job_id} attempt {a}" for job_id, a in {**strays, **cancelled}.items()
                ),
                given,
                ended,
            )

    async def _give_back_strays(
        self, conn: psycopg.AsyncConnection[Any], strays: dict[int, int]
    ) -> int:
        """Give back the jobs (id -> attempt) this worker does not run; returns how many."""
        if not strays:
            return 0
        cur = await conn.execute(
            self._give_back,
            {
                **fenced_batch({job_id: {"attempt": a} for job_id, a in strays.items()}),
                "worker_id": self.worker_id,
                "channel": self._channel,
            },
        )
        return sum(int(row[1]) for row in await cur.fetchall())

    async def _end_cancelled(
        self, conn: psycopg.AsyncConnection[Any], cancelled: dict[int, int]
    ) -> int:
        """End cancelled, as asked, the jobs (id -> attempt) this worker does not run;
        returns how many."""
        if not cancelled:
            return 0
        entries = {job_id: {"attempt": a, "progress": None} for job_id, a in cancelled.items()}
        cur = await conn.execute(
            self._cancel, {**fenced_batch(entries), "worker_id": self.worker_id}
        )
        ended = len(await cur.fetchall())
        if ended:
            await conn.execute(*self._results_notice)
        return ended

    def _beaten(self, asked_at: float) -> None:
        """Every lease held at ``asked_at`` is confirmed, or its loss acted on."""
        if self.on_beat is not None:
            self.on_beat(asked_at)

    async def _write_progress(self, conn: psycopg.AsyncConnection[Any]) -> None:
        pending = self.running.take_progress()
        for job_id, (attempt, encoded) in pending.items():
            await conn.execute(
                self._progress,
                {
                    "id": job_id,
                    "attempt": attempt,
                    "worker_id": self.worker_id,
                    "progress": encoded,
                },
            )


def _by_handler(held: dict[int, RunningJob], job_id: int) -> bool:
    """Whether the job's handler completed it in its own transaction, whose lock on the
    row the beat skipped: expected, not worth a warning."""
    entry = held.get(job_id)
    return entry is not None and entry.completed_by_handler
