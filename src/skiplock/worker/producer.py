"""Claiming for free capacity: a producer per queue (and per execution mode).

A producer asks for at most as many jobs as there are free slots, claims again at once
when a full batch came back (more is probably waiting), and otherwise sleeps until a
notification, a slot frees up, or the poll interval passes, whichever is first.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

import psycopg

from skiplock.retry import RetryPolicy
from skiplock.waiting import wait_event

log = logging.getLogger("skiplock.worker.producer")

RECONNECT = RetryPolicy(base=0.1, factor=2.0, cap=10.0, jitter=0.5)


class Slots:
    """Free execution capacity shared by every producer of a worker process."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._freed = asyncio.Event()
        self._freed.set()

    def take(self, n: int) -> None:
        self.free -= n
        if self.free <= 0:
            self._freed.clear()

    def give(self, n: int = 1) -> None:
        self.free += n
        self._freed.set()

    async def wait_free(self, enough: int = 1, patience: float = 0.0) -> None:
        """Wait for a free slot, then up to ``patience`` seconds more for ``enough`` of them.

        Short jobs free slots one at a time; claiming the moment one frees would mean a
        round trip per job. A moment's patience turns that into one claim per batch.
        """
        while self.free <= 0:
            self._freed.clear()
            await self._freed.wait()
        if self.free >= enough or patience <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while self.free < enough:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._freed.clear()
            await wait_event(self._freed, remaining)

    @property
    def busy(self) -> int:
        return self.total - self.free


# A fetch claims at most `limit` units of work, starts them, and says how many it got.
Fetch = Callable[[int], Awaitable[int]]


class Producer:
    def __init__(
        self,
        name: str,
        fetch: Fetch,
        slots: Slots,
        wake: asyncio.Event,
        *,
        batch_max: int,
        poll_interval: float,
        fetch_patience: float = 0.002,
        backpressure: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self._fetch = fetch
        self._slots = slots
        self._wake = wake
        self._batch_max = batch_max
        self._poll_interval = poll_interval
        self._patience = fetch_patience
        self._backpressure = backpressure
        self.claims = 0
        self.pending: asyncio.Future[int] | None = None

    async def run(self) -> None:
        rng = random.Random()
        failures = 0
        while True:
            await self._slots.wait_free(
                min(self._batch_max, max(1, self._slots.total // 2)), self._patience
            )
            if self._backpressure is not None:
                await self._backpressure()
            want = min(self._slots.free, self._batch_max)
            if want <= 0:
                continue
            # Clear before claiming: a notification that lands during the claim re-arms it.
            self._wake.clear()
            try:
                # Shielded: a claim commits in the database before its rows reach us, so
                # cancelling it half-way (at shutdown) would strand the claimed jobs. The
                # worker awaits `pending` before it drains.
                self.pending = asyncio.ensure_future(self._fetch(want))
                got = await asyncio.shield(self.pending)
                failures = 0
            except psycopg.OperationalError as exc:
                failures += 1
                delay = RECONNECT.delay(failures, rng)
                log.warning("%s: claim failed (%s); retrying in %.2fs", self.name, exc, delay)
                await asyncio.sleep(delay)
                continue
            except Exception:
                # Anything else must not end claiming on this queue for good.
                failures += 1
                delay = RECONNECT.delay(failures, rng)
                log.exception("%s: claim failed; retrying in %.2fs", self.name, delay)
                await asyncio.sleep(delay)
                continue
            self.claims += 1
            if got >= want:
                continue  # a full batch: more is probably waiting
            await wait_event(self._wake, self._poll_interval)
