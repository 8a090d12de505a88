"""Queue limits as this worker applies them: which of its queues have a concurrency or
rate limit (read at start, every few seconds, and at once on a 'limits' control message),
and the claims and rate reservations of those queues. Queues without limits never come
here: their claims stay one statement.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from psycopg_pool import AsyncConnectionPool

from skiplock.sql import claim, render

# How often limits are re-read when no 'limits' message arrives.
REFRESH_SECONDS = 5.0


class QueueLimits:
    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        schema: str,
        queues: list[str],
        wake: dict[str, asyncio.Event],
    ) -> None:
        self._pool = pool
        self._queues = queues
        self._wake = wake
        self.governed: set[str] = set()
        self._reading: asyncio.Task[None] | None = None
        self._read_again = False
        self._limits = render(claim.QUEUE_LIMITS, schema)
        self._govern = render(claim.QUEUE_GOVERN, schema)
        self._running = render(claim.QUEUE_RUNNING, schema)
        self._spend = render(claim.QUEUE_RATE_SPEND, schema)

    def __contains__(self, queue: str) -> bool:
        return queue in self.governed

    async def read(self) -> None:
        """Which of this worker's queues claim through the limited path."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(self._limits, {"queues": self._queues})
            governed = {str(r[0]) for r in await cur.fetchall()}
        for queue in governed ^ self.governed:
            self._wake[queue].set()  # claim at once under the new rules
        self.governed = governed

    def read_soon(self) -> None:
        """Limits changed: read them now. The next claim of any queue waits for this
        read, so jobs enqueued after the change committed are claimed under it. Asked
        while a read runs, one more read follows it (the running one may have started
        before the change committed): anyone can send 'limits', and a flood of them
        costs one read at a time."""
        if self._reading is not None and not self._reading.done():
            self._read_again = True
            return
        self._reading = asyncio.get_running_loop().create_task(self._read_until_settled())

    async def _read_until_settled(self) -> None:
        self._read_again = True
        while self._read_again:
            self._read_again = False
            await self.read()

    async def settled(self) -> None:
        """Wait for a read that a 'limits' message started (its failure is not ours)."""
        reading = self._reading
        if reading is not None and not reading.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(reading)

    def room_freed(self) -> None:
        """Outcomes were written: a limited queue may have held jobs back for want of the
        room that just freed up."""
        for queue in self.governed:
            self._wake[queue].set()

    async def claim(self, queue: str, statement: str, params: dict[str, Any]) -> list[Any]:
        """Claim from a queue with limits: take turns on its row (QUEUE_GOVERN), then
        claim no more than its concurrency limit and its rate allow."""
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._govern, {"queue": queue})
            settings = await cur.fetchone()
            limit = int(params["limit"])
            if settings is not None:
                concurrency, room, frees_in = settings
                if concurrency is not None:
                    cur = await conn.execute(self._running, {"queue": queue})
                    running = await cur.fetchone()
                    assert running is not None
                    limit = min(limit, concurrency - int(running[0]))
                if room is not None:
                    if room < limit and frees_in is not None:
                        # The rate holds jobs back: claim again when the oldest start in
                        # the window leaves it.
                        self._wake_in(queue, float(frees_in))
                    limit = min(limit, int(room))
            if limit <= 0:
                return []
            cur = await conn.execute(statement, {**params, "limit": limit})
            rows: list[Any] = await cur.fetchall()
            if settings is not None and settings[1] is not None and rows:
                await conn.execute(self._spend, {"queue": queue, "spent": len(rows)})
        return rows

    async def reserve(self, queue: str, want: int) -> int:
        """A transactional session holds its claim for the whole batch, so a limited
        queue's rate is reserved first, in a short transaction of its own. A reservation
        the session does not use is lost: the rate is never exceeded, at worst under-used.
        (Transactional jobs are never 'running': the concurrency limit does not count them.)"""
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._govern, {"queue": queue})
            settings = await cur.fetchone()
            if settings is None or settings[1] is None:
                return want
            room, frees_in = int(settings[1]), settings[2]
            if room < want and frees_in is not None:
                self._wake_in(queue, float(frees_in))
            granted = max(min(want, room), 0)
            if granted:
                await conn.execute(self._spend, {"queue": queue, "spent": granted})
        return granted

    def _wake_in(self, queue: str, seconds: float) -> None:
        asyncio.get_running_loop().call_later(max(seconds, 0.001), self._wake[queue].set)
