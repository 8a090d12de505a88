"""Transactional mode: a session claims a batch and runs each of its jobs inside the one
transaction that holds the claim (executor.run_transactional_async / _sync), so a job's
own writes commit with its outcome. A producer per queue and kind (async handlers on the
event loop, sync handlers in the thread pool) starts sessions while slots are free.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from psycopg_pool import AsyncConnectionPool, ConnectionPool

from skiplock import executor
from skiplock.app import App
from skiplock.worker.limits import QueueLimits
from skiplock.worker.producer import Producer, Reservation, Slots

log = logging.getLogger("skiplock.worker")

# Starts a session: it sets the future to the number of jobs it claimed, then runs them.
Start = Callable[[asyncio.Future[int], int], Coroutine[Any, Any, None]]


class TransactionalSessions:
    def __init__(
        self,
        app: App,
        limits: QueueLimits,
        *,
        batch: int,
        poll_interval: float,
        rng: random.Random,
        on_claimed: Callable[[str, int], None],
        on_completed: Callable[[int], None],
        on_finished: executor.Finished,
        gate: asyncio.Semaphore | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.batch = batch
        self.poll_interval = poll_interval
        self._rng = rng
        self._on_claimed = on_claimed
        self._on_completed = on_completed
        self._on_finished = on_finished
        # With prefetch, a session takes a run permit before it starts, in line with the
        # jobs claimed ahead (it runs as soon as it starts).
        self._gate = gate
        # Sessions running, and those of them in a thread (which cannot be cancelled).
        self.running: set[asyncio.Task[None]] = set()
        self.in_threads: set[asyncio.Task[None]] = set()

    def producer(
        self, queue: str, slots: Slots, wake: asyncio.Event, start: Start, *, in_thread: bool
    ) -> Producer:
        limits = self.limits
        gate = self._gate

        async def fetch(reservation: Reservation) -> bool:
            batch = self.batch
            await limits.settled()
            if queue in limits:
                batch = await limits.reserve(queue, batch)
                if batch <= 0:
                    return False
            claimed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            reservation.keep(1)  # the session gives it back when it ends
            session = asyncio.create_task(start(claimed, batch))
            if gate is not None and reservation.take_permit():
                session.add_done_callback(lambda _: gate.release())
            self.running.add(session)
            session.add_done_callback(self.running.discard)
            if in_thread:
                self.in_threads.add(session)
                session.add_done_callback(self.in_threads.discard)
            got = await claimed
            # A full batch means more may be waiting: start another session at once.
            return got >= self.batch

        return Producer(
            f"{queue}/transactional/{'sync' if in_thread else 'async'}",
            fetch,
            slots,
            wake,
            batch_max=1,
            poll_interval=self.poll_interval,
            fetch_patience=0.0,
            gate=gate,
        )

    def async_session(
        self, pool: AsyncConnectionPool[Any], queue: str, tasks: list[str], slots: Slots
    ) -> Start:
        async def session(claimed: asyncio.Future[int], batch: int) -> None:
            def on_claimed(n: int) -> None:
                self._on_claimed(queue, n)
                claimed.set_result(n)

            try:
                async with pool.connection() as conn:
                    done = await executor.run_transactional_async(
                        self.app,
                        conn,
                        queue,
                        tasks,
                        batch,
                        rng=self._rng,
                        on_claimed=on_claimed,
                        on_finished=self._on_finished,
                    )
                self._on_completed(done)
            except BaseException as exc:
                if not claimed.done():
                    claimed.set_exception(exc)
                elif not isinstance(exc, asyncio.CancelledError):
                    log.exception("transactional session on %s failed; rolled back", queue)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            finally:
                slots.give(1)

        return session

    def sync_session(
        self,
        pool: ConnectionPool[Any],
        queue: str,
        tasks: list[str],
        slots: Slots,
        threads: ThreadPoolExecutor,
    ) -> Start:
        loop = asyncio.get_running_loop()

        def run_in_thread(claimed: asyncio.Future[int], batch: int) -> int:
            def on_claimed(n: int) -> None:
                self._on_claimed(queue, n)
                loop.call_soon_threadsafe(claimed.set_result, n)

            with pool.connection() as conn:
                return executor.run_transactional_sync(
                    self.app,
                    conn,
                    queue,
                    tasks,
                    batch,
                    rng=random.Random(),
                    on_claimed=on_claimed,
                    on_finished=self._on_finished,
                )

        async def session(claimed: asyncio.Future[int], batch: int) -> None:
            try:
                done = await loop.run_in_executor(threads, run_in_thread, claimed, batch)
                self._on_completed(done)
            except Exception as exc:
                if not claimed.done():
                    claimed.set_exception(exc)
                else:
                    log.exception("transactional session on %s failed; rolled back", queue)
            finally:
                slots.give(1)

        return session
