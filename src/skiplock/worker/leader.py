"""The duties done once for the whole fleet, by the elected leader, each a service.

Election decides who leads; rescue, admission and history act only while this worker
leads. Promotion and cron run on every worker: promotion makes this worker's retries due
on time, cron enqueues the ticks of this worker's own schedules (decision 021: other
services sharing the schema have schedules of their own).

Every statement here runs on the maintenance pool, whose connections bound each
statement (timeouts.MAINTENANCE): a user's transaction holding a row or a key one of them
needs ends that pass, which is tried again on the next one. It never delays heartbeats
(their own connection) nor the other duties (their own loops).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg
from psycopg_pool import AsyncConnectionPool

from skiplock import admission, history
from skiplock.config import notify_channel
from skiplock.leadership import Leadership
from skiplock.periodic import tick_due
from skiplock.sql import maintenance, render, signals
from skiplock.waiting import wait_event
from skiplock.wording import plural
from skiplock.worker.supervisor import PeriodicService, describe
from skiplock.worker.timeouts import MAINTENANCE

if TYPE_CHECKING:
    from skiplock.app import App

log = logging.getLogger("skiplock.worker.leader")

Pool = AsyncConnectionPool[Any]

# Keys remembered between admission passes; past this, one full pass instead.
ADMIT_KEYS_MAX = 1000
# A full pass asked for by a notification runs at most this often: anyone who can connect
# can send 'admit', and a full pass reads every waiting key. Requests in between are
# coalesced into one pass at the end of the interval (keyed passes are not held back).
ASKED_FULL_SECONDS = 1.0
# A key another admitter held during a pass (a completion admitting it: decision 017) is
# asked about again this many seconds later: that admitter's snapshot may predate what
# this pass was asked for.
BUSY_RETRY_SECONDS = 0.05


@dataclass(eq=False)
class Election(PeriodicService):
    """Become or stay leader (LEADER_ELECT). Leaders renew at a third of the ttl,
    followers try about every ``follower_every`` seconds. A failed attempt gives up
    leadership at once: a leader that cannot reach its row must not act as one."""

    name = "election"
    log = log

    pool: Pool
    schema: InitVar[str]
    worker_id: UUID
    leadership: Leadership
    _: KW_ONLY
    follower_every: float
    on_elected: Callable[[], None]
    _elect: str = field(init=False)

    def __post_init__(self, schema: str) -> None:
        self._elect = render(maintenance.LEADER_ELECT, schema)

    async def run_once(self) -> None:
        now = asyncio.get_running_loop().time()
        was_leader = self.leadership.is_leader(now)
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._elect, {"worker_id": self.worker_id, "ttl": self.leadership.ttl}
            )
            won = await cur.fetchone() is not None
        self.leadership.record(won=won, asked_at=now)
        if won and not was_leader:
            self.on_elected()

    def failed(self, exc: Exception) -> None:
        self.leadership.lose()

    async def pause(self) -> None:
        now = asyncio.get_running_loop().time()
        await asyncio.sleep(self.leadership.next_attempt_in(now, self.follower_every))


class LeaderService(PeriodicService):
    """A duty done only while this worker leads, a pass every ``tick`` seconds."""

    log = log

    def __init__(self, leadership: Leadership, tick: float) -> None:
        self.leadership = leadership
        self._tick = tick
        # Set when this worker is elected: a new leader's first pass runs at once, not a
        # tick later (a dead leader's own jobs wait for it).
        self.wake = asyncio.Event()

    def leading(self) -> bool:
        return self.leadership.is_leader(asyncio.get_running_loop().time())

    async def pause(self) -> None:
        await wait_event(self.wake, self._tick)
        self.wake.clear()


class Rescue(LeaderService):
    """Give back the jobs of dead workers (by liveness lock, every pass; those whose
    cancellation was asked for end cancelled), and every ``expired_every`` those of
    expired leases and the running rows no live worker wrote (decision 022): those scans
    walk the running index, which grows while VACUUM is held back."""

    name = "rescue"

    def __init__(
        self,
        pool: Pool,
        schema: str,
        worker_id: UUID,
        leadership: Leadership,
        *,
        tick: float,
        expired_every: float,
        on_rescued: Callable[[int], None],
    ) -> None:
        super().__init__(leadership, tick)
        self._pool = pool
        self._worker_id = worker_id  # never taken for gone by its own rescue
        self._params = {"channel": notify_channel(schema), "worker_id": worker_id}
        self._expired_every = expired_every
        self._on_rescued = on_rescued
        self._gone = render(maintenance.WORKERS_GONE, schema)
        self._orphaned = render(maintenance.JOB_RESCUE_ORPHANED, schema)
        self._expired = [
            render(maintenance.JOB_RESCUE_EXPIRED, schema),
            render(maintenance.JOB_RESCUE_STRAY, schema),
            render(maintenance.JOB_CANCEL_ABANDONED, schema),
        ]
        self._next_expired = 0.0

    async def run_once(self) -> None:
        if not self.leading():
            return
        now = asyncio.get_running_loop().time()
        statements = []
        if now >= self._next_expired:
            # Each walks the running index; every half lease is soon enough for a hung
            # worker's jobs, for rows no worker wrote and for cancellations whose worker
            # is gone.
            self._next_expired = now + self._expired_every
            statements = self._expired
        rescued = 0
        async with self._pool.connection() as conn:
            async with conn.transaction():
                cur = await conn.execute(self._gone, {"worker_id": self._worker_id})
                gone = [row[0] for row in await cur.fetchall()]
                if gone:
                    cur = await conn.execute(self._orphaned, {**self._params, "workers": gone})
                    rescued += sum(int(row[1]) for row in await cur.fetchall())
            for statement in statements:
                # Each statement notifies the queues it refilled (and so us).
                cur = await conn.execute(statement, self._params)
                rescued += sum(int(row[1]) for row in await cur.fetchall())
        if rescued:
            self._on_rescued(rescued)
            log.warning("rescued %s of dead workers or expired leases", plural(rescued, "job"))


@dataclass(eq=False)
class PeriodicTicks(PeriodicService):
    """Enqueue the due ticks of this worker's own periodic tasks (periodic.tick_due), on
    every worker, leader or not: a schedule ticks while any live worker that defines it
    runs, each tick once (decision 021). A pass sleeps until the next tick comes due, at
    most RECHECK_SECONDS (a row an operator deleted to restart a schedule is seen again
    by then); a pass the database ended is tried again ``tick`` seconds later."""

    name = "cron"
    log = log
    RECHECK_SECONDS = 10.0

    pool: Pool
    app: App
    _: KW_ONLY
    tick: float
    _sleep_for: float = field(init=False)

    def __post_init__(self) -> None:
        self._sleep_for = self.tick

    async def run_once(self) -> None:
        self._sleep_for = self.tick  # a pass the database ends is tried again soon
        if not self.app.periodics:
            self._sleep_for = self.RECHECK_SECONDS
            return
        async with self.pool.connection() as conn:
            done = await tick_due(conn, self.app)
        until = done.seconds_to_next_tick
        if until is not None:
            # Just after the tick: the database's clock decides when it is due.
            self._sleep_for = min(max(until + 0.001, 0.001), self.RECHECK_SECONDS)

    async def pause(self) -> None:
        await asyncio.sleep(self._sleep_for)


class History(LeaderService):
    """Partitions of the history table ahead, expired ones dropped, every ``every``
    seconds, on a connection of its own in a thread (the DDL is synchronous code)."""

    name = "history"

    def __init__(
        self,
        database_url: str,
        schema: str,
        leadership: Leadership,
        *,
        tick: float,
        every: float,
        retention: timedelta | None,
        connect_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(leadership, tick)
        self._url = database_url
        # Behind a pooler no ``options`` and no prepared statements (pooler.py).
        self._connect_kwargs = (
            {"options": MAINTENANCE.options("")} if connect_kwargs is None else connect_kwargs
        )
        self._schema = schema
        self._every = every
        self._retention = retention
        self._next = 0.0

    async def run_once(self) -> None:
        now = asyncio.get_running_loop().time()
        if now < self._next or not self.leading():
            return
        self._next = now + self._every
        report = await asyncio.to_thread(self._maintain)
        pruned = report.pruned_rows or report.pruned_workflows or report.pruned_steps
        if report.created or report.dropped or pruned:
            log.info(
                "history: created %s, dropped %s, pruned %d rows, %d ended workflows and "
                "%d steps of ended jobs",
                report.created,
                report.dropped,
                report.pruned_rows,
                report.pruned_workflows,
                report.pruned_steps,
            )

    def _maintain(self) -> history.HistoryReport:
        with psycopg.connect(
            self._url, autocommit=True, connect_timeout=10, **self._connect_kwargs
        ) as conn:
            return history.maintain(conn, self._schema, retention=self._retention)


@dataclass(eq=False)
class KeyAdmission:
    """As leader, admit waiting keyed jobs: the keys notifications name at once (new
    keys, keys a completion could not admit itself: decision 017), rate-limited keys when
    their window makes room, every key with waiting jobs on taking over and after the
    listener reconnected (notifications may have been lost), and every ``every`` seconds
    the keys with waiting jobs and none admitted, the only ones a lost request can leave
    waiting for good."""

    name = "admission"

    pool: Pool
    schema: str
    leadership: Leadership
    _: KW_ONLY
    every: float
    retry_after: float
    on_admitted: Callable[[int], None]
    _keys: set[str] = field(init=False, default_factory=set)
    _all: bool = field(init=False, default=True)
    # By a notification: coalesced (ASKED_FULL_SECONDS).
    _asked_all: bool = field(init=False, default=False)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)

    def ask(self, key: str) -> None:
        """A notification asked for ``key`` (empty: for every key)."""
        # Only the leader acts on these; the others forget them (a new leader starts
        # with a full pass). A flood is cheaper as one full pass than key by key.
        if not self.leadership.is_leader(asyncio.get_running_loop().time()):
            return
        if key and len(self._keys) < ADMIT_KEYS_MAX:
            self._keys.add(key)
        else:
            self._asked_all = True
        self._wake.set()

    def ask_all(self) -> None:
        """Admit every waiting key at the next pass (on taking over, after a reconnect)."""
        self._all = True
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_full = loop.time()
        last_full = float("-inf")
        # Keys to ask about again, and when: rate-limited keys when their window makes
        # room, keys another admitter held soon.
        keys_due: dict[str, float] = {}
        while True:
            due = [next_full, *keys_due.values()]
            if self._asked_all:
                due.append(last_full + ASKED_FULL_SECONDS)
            await wait_event(self._wake, min(due) - loop.time())
            self._wake.clear()
            now = loop.time()
            if not self.leadership.is_leader(now):
                self._keys.clear()
                self._all = True
                self._asked_all = False
                keys_due.clear()
                next_full = now + self.every
                continue
            asked: list[str] | None = sorted(
                self._keys | {key for key, at in keys_due.items() if at <= now}
            )
            self._keys = set()
            periodic = False
            if self._all or (self._asked_all and now >= last_full + ASKED_FULL_SECONDS):
                asked = None
                if self._asked_all:
                    # Only passes that served a request delay the next one: a request
                    # just after the pass on start (a bulk enqueue of many keys as the
                    # worker comes up) is served at once.
                    last_full = now
                self._all = self._asked_all = False
                next_full = now + self.every
            elif now >= next_full:
                # Asked for by no one: the keys that can wait forever (KEYS_STALLED),
                # with the keys asked about.
                periodic = True
                next_full = now + self.every
            elif not asked:
                continue
            try:
                if periodic:
                    admitted, next_due = await self.admit_stalled(asked or [])
                else:
                    admitted, next_due = await self.admit_pass(asked)
            except psycopg.Error as exc:
                self._all = True
                log.warning("admitting keyed jobs failed (%s); will retry", describe(exc))
                await asyncio.sleep(self.retry_after)
                continue
            # Keys not yet due stay due, unless this pass visited every key.
            kept = {} if asked is None else {k: at for k, at in keys_due.items() if at > now}
            keys_due = kept | {key: loop.time() + seconds for key, seconds in next_due.items()}
            if admitted:
                self.on_admitted(admitted)
                log.debug("admitted %d keyed jobs", admitted)

    async def admit_pass(self, asked: list[str] | None) -> tuple[int, dict[str, float]]:
        """One admission (of the ``asked`` keys, None: of every waiting key): the jobs
        admitted, and the keys to ask about again with the seconds until then (rate-limited
        keys when their window makes room, keys another admitter held soon). The whole
        database side of this service: skiplock.admission, where one bad key or row fails
        alone."""
        async with self.pool.connection() as conn:
            report = await admission.admit_pass(conn, self.schema, asked)
        return report.admitted, self._due(report)

    async def admit_stalled(self, asked: list[str]) -> tuple[int, dict[str, float]]:
        """The periodic pass: the ``asked`` keys and every key with waiting jobs and none
        admitted (a key with admitted jobs is admitted again when one of them ends);
        returns as admit_pass."""
        async with self.pool.connection() as conn:
            report = await admission.admit_pass(conn, self.schema, asked, stalled=True)
        return report.admitted, self._due(report)

    @staticmethod
    def _due(report: admission.AdmissionReport) -> dict[str, float]:
        due = dict(report.rate_due)
        for key in report.busy:
            due.setdefault(key, BUSY_RETRY_SECONDS)
        return due


@dataclass(eq=False)
class Promotion(PeriodicService):
    """Make scheduled and retryable jobs available when due, and waits for a signal whose
    time is up, sleeping until the next one comes due (at most ``poll_interval``) or
    until this worker writes a retry (``wake``)."""

    name = "promotion"
    log = log
    BATCH = 1000

    pool: Pool
    schema: InitVar[str]
    _: KW_ONLY
    poll_interval: float
    wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _promote: str = field(init=False)
    _timed_out: str = field(init=False)
    _next_due: str = field(init=False)
    _channel: str = field(init=False)
    _sleep_for: float = field(init=False)

    def __post_init__(self, schema: str) -> None:
        self._promote = render(maintenance.JOB_PROMOTE_DUE, schema)
        self._timed_out = render(signals.JOB_WAITS_TIMED_OUT, schema)
        self._next_due = render(maintenance.JOB_NEXT_DUE, schema)
        self._channel = notify_channel(schema)
        self._sleep_for = self.poll_interval

    async def run_once(self) -> None:
        self._sleep_for = self.poll_interval
        self.wake.clear()
        async with self.pool.connection() as conn:
            for statement in (self._promote, self._timed_out):
                while True:
                    cur = await conn.execute(
                        statement, {"limit": self.BATCH, "channel": self._channel}
                    )
                    moved = sum(int(row[1]) for row in await cur.fetchall())
                    if moved < self.BATCH:
                        break
            cur = await conn.execute(self._next_due)
            row = await cur.fetchone()
        if row is not None and row[0] is not None:
            self._sleep_for = min(max(float(row[0]), 0.001), self.poll_interval)

    async def pause(self) -> None:
        await wait_event(self.wake, self._sleep_for)
        self._sleep_for = self.poll_interval
