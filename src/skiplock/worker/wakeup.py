"""How inserts wake this worker without every insert paying for a notification
(decision 023).

A process whose producer finds its queue empty becomes the queue's sentinel
(``WakeupSession.arm``): its own session holds the queue's waiting key, and from then on
inserts into the queue notify. It lets go as soon as the queue wakes it or a claim brings
jobs, so a busy fleet costs inserts nothing. Busy workers hear no notification, so a job
that commits behind one's claim cursor is found by ``LateCommits``, which reads the jobs
of the transactions that were still open at its previous read.

One dedicated connection carries both: session-level advisory locks need a session of
their own, never a pooled one. Losing it loses the keys with it; producers then poll, and
arm again on their next idle moment.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Callable
from typing import Any

import psycopg

from skiplock.config import notify_channel
from skiplock.cursor import LateReads
from skiplock.sql import render, wakeup
from skiplock.worker.cursors import CursorWatch

log = logging.getLogger("skiplock.worker.wakeup")

# How often an idle process checks that its wake-up session (holding its keys) is there.
PING_SECONDS = 1.0


class Armed(enum.Enum):
    """What arming a queue's sentinel came to (sql/wakeup.py, SENTINEL_ARM)."""

    NOW = "armed"  # this session holds the keys now: claim once more, then sleep
    ALREADY = "already"  # it held them already: sleep until woken
    COVERED = "covered"  # another session is the sentinel: its notifications wake us too
    IN_FLIGHT = "in flight"  # an insert not yet committed stands in the way: poll soon
    UNAVAILABLE = "unavailable"  # no session: poll


class WakeupSession:
    """The process's sentinel keys and late-commit reads, on one dedicated connection."""

    def __init__(
        self,
        url: str,
        schema: str,
        *,
        connect_kwargs: dict[str, Any] | None = None,
        on_lost: Callable[[str], None] = lambda queue: None,
    ) -> None:
        self._url = url
        # Told of each queue whose keys went with the session: its producers sleep on
        # them and must arm again.
        self._on_lost = on_lost
        self._schema = schema
        self._connect_kwargs = connect_kwargs or {}
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()
        self._arm = render(wakeup.SENTINEL_ARM, schema)
        self._disarm = render(wakeup.SENTINEL_DISARM, schema)
        self._hand_over = render(wakeup.SENTINEL_HAND_OVER, schema)
        self._channel = notify_channel(schema)
        # Queues whose keys this session holds, and who waits on each (producers).
        self.armed: set[str] = set()
        self._waiting: dict[str, set[object]] = {}
        # Queues another session guards, as last seen: their inserts notify already.
        self.covered: set[str] = set()
        self._releases: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()
        # Bumped whenever the session is given up: an answer from the one before says
        # nothing of the keys now.
        self._generation = 0

    def notified(self, queue: str) -> bool:
        """Whether inserts into ``queue`` notify now, as far as this process knows."""
        return queue in self.armed or queue in self.covered

    async def arm(self, queue: str, who: object) -> Armed:
        """``who`` waits on ``queue``: make sure inserts into it wake this process."""
        self._waiting.setdefault(queue, set()).add(who)
        if queue in self.armed:
            return Armed.ALREADY
        async with self._lock:
            if queue in self.armed:
                return Armed.ALREADY
            generation = self._generation
            try:
                conn = await self._connection()
                cur = await conn.execute(self._arm, {"queue": queue, "schema": self._schema})
                row = await cur.fetchone()
            except psycopg.OperationalError as exc:
                self._lost(exc)
                return Armed.UNAVAILABLE
            if generation != self._generation:
                return Armed.UNAVAILABLE  # reset meanwhile: those keys go with that session
        answer = Armed(row[0]) if row is not None else Armed.UNAVAILABLE
        if answer is Armed.NOW:
            self.armed.add(queue)
        if answer is Armed.COVERED:
            self.covered.add(queue)
        else:
            self.covered.discard(queue)
        return answer

    def busy(self, queue: str, who: object) -> None:
        """``who`` no longer waits on ``queue`` (its claim brought jobs)."""
        waiting = self._waiting.get(queue)
        if waiting:
            waiting.discard(who)
        if not waiting:
            self._release(queue, tell=True)

    def woken(self, queue: str) -> None:
        """A notification woke ``queue``'s producers: they claim now, and arm again if
        they find nothing. Inserts meanwhile need not notify."""
        self._waiting.pop(queue, None)
        self.covered.discard(queue)
        self._release(queue, tell=False)  # the notification woke the others too

    async def hand_over(self) -> None:
        """Let every key go and tell the other workers (this one is stopping)."""
        self._waiting.clear()
        for queue in sorted(self.armed):
            await self._disarm_once(queue, tell=True)

    def _release(self, queue: str, *, tell: bool) -> None:
        if queue not in self.armed:
            return
        task = asyncio.get_running_loop().create_task(self._disarm_once(queue, tell=tell))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _disarm_once(self, queue: str, *, tell: bool) -> None:
        async with self._lock:
            if queue not in self.armed or self._waiting.get(queue):
                return  # armed again meanwhile, or never was
            # Not armed from here on: a producer arming meanwhile waits for the lock and
            # takes the keys again, instead of sleeping on keys about to go.
            self.armed.discard(queue)
            if self._conn is None:
                return  # the session went, and the keys with it
            try:
                await self._conn.execute(
                    self._hand_over if tell else self._disarm,
                    {"queue": queue, "schema": self._schema, "channel": self._channel},
                )
            except psycopg.OperationalError as exc:
                self._lost(exc)

    async def read_late(self, statement: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        async with self._lock:
            try:
                conn = await self._connection()
                cur = await conn.execute(statement, params)
                return await cur.fetchall()
            except psycopg.OperationalError as exc:
                self._lost(exc)
                raise

    async def ping(self) -> None:
        """Find out whether the session (and with it every key) is still there: a lost
        connection shows only when it is used, and armed queues use it for nothing."""
        async with self._lock:
            if self._conn is None:
                return
            try:
                await self._conn.execute("SELECT 1")
            except psycopg.OperationalError as exc:
                self._lost(exc)

    def reset(self) -> None:
        """Forget every key (the listener reconnected: the server may have restarted,
        taking this session with it)."""
        if self._conn is not None:
            self._lost(psycopg.OperationalError("the listener reconnected"))

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self._url, autocommit=True, **self._connect_kwargs
            )
        return self._conn

    def _lost(self, exc: Exception) -> None:
        """The connection went, and every key with it."""
        lost = sorted(self.armed)
        if lost:
            log.warning("wake-up session lost (%s): arming %s again", exc, ", ".join(lost))
        self.armed.clear()
        self.covered.clear()
        for queue in lost:
            self._on_lost(queue)
        self._generation += 1
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            task = asyncio.get_running_loop().create_task(self._close(conn))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Under the lock: a statement may still be running on it (a reset comes from the
        # listener, at any moment), and closing a connection under a statement is unsafe.
        async with self._lock:
            await conn.close()

    async def close(self) -> None:
        for task in list(self._releases):
            task.cancel()
        await asyncio.gather(*self._releases, *self._closing, return_exceptions=True)
        async with self._lock:
            if self._conn is not None:
                await self._conn.close()
            self._conn = None
        self.armed.clear()


class LateCommits(CursorWatch[WakeupSession]):
    """Every ``every`` seconds, find jobs that committed behind a busy queue's claim
    cursor and rewind it to them (sql/wakeup.py, JOB_LATE_COMMITS). A queue whose inserts
    notify (a sentinel waits on it) is left out: its notifications rewind the cursor."""

    name = "late commits"
    log = log
    statement = wakeup.JOB_LATE_COMMITS
    _pinged = float("-inf")

    @functools.cached_property
    def reads(self) -> LateReads:
        """Where each queue's next read resumes."""
        return LateReads()

    async def pause(self) -> None:
        if not self.reads.cut_short:
            await asyncio.sleep(self._every)

    async def run_once(self) -> None:
        queues = [q for q in self._cursors if not self._source.notified(q)]
        if not queues:
            now = asyncio.get_running_loop().time()
            if now - self._pinged >= PING_SECONDS:
                self._pinged = now
                await self._source.ping()
            return
        rows = await self._source.read_late(
            self._statement, self.reads.params(queues, self._excluded)
        )
        for queue, position in self.reads.read(queues, rows).items():
            self.found(queue, position)
