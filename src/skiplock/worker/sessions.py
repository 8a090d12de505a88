"""Transactional mode: a session claims a batch and runs each of its jobs inside the one
transaction that holds the claim (executor.run_transactional_async / _sync), so a job's
own writes commit with its outcome. A producer per queue and kind (async handlers on the
event loop, sync handlers in the thread pool) starts sessions while slots are free.

A worker's stop reaches each session's batch (executor.BatchStop): once asked, no session
starts another job, and each commits what finished; at the shutdown deadline, ``cut_short``
cuts the jobs still running short, and their batches commit without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from psycopg_pool import AsyncConnectionPool, ConnectionPool

from skiplock import executor
from skiplock.app import App
from skiplock.worker.limits import QueueLimits
from skiplock.worker.producer import Producer, Reservation, Slots
from skiplock.worker.wakeup import WakeupSession

log = logging.getLogger("skiplock.worker")

# Starts a session: it sets the future to the number of jobs it claimed, then runs them
# (as far as the BatchStop lets it).
Start = Callable[[asyncio.Future[int], int, executor.BatchStop, bool], Coroutine[Any, Any, None]]
# How long cut-short sessions get to commit what finished before they are given up on
# (and roll back whole): a commit, and a cancel request for a sync handler's statement.
CUT_SECONDS = 10.0


@dataclass(eq=False)
class TransactionalSessions:
    app: App
    limits: QueueLimits
    _: KW_ONLY
    batch: int
    poll_interval: float
    rng: random.Random
    on_claimed: Callable[[str, int], None]
    on_completed: Callable[[int], None]
    on_finished: executor.Finished
    # With prefetch, a session takes a run permit before it starts, in line with the jobs
    # claimed ahead (it runs as soon as it starts).
    gate: asyncio.Semaphore | None = None
    # Sessions running, and those of them in a thread (which cannot be cancelled).
    running: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    in_threads: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    # Set once the worker is asked to stop; each session's batch reads it.
    _stopping: threading.Event = field(init=False, default_factory=threading.Event)
    _batches: dict[asyncio.Task[None], executor.BatchStop] = field(init=False, default_factory=dict)

    def stop(self) -> None:
        """The worker is asked to stop: no session starts another job (decision 002)."""
        self._stopping.set()

    async def cut_short(self, timeout: float = CUT_SECONDS) -> int:
        """The shutdown deadline: every session still running cuts its running job short
        and commits the jobs finished before it (executor.BatchStop.cut). An async
        handler is cancelled and its session commits; a sync one's thread cannot be
        stopped, so its batch is committed for it, from a thread of its own. Sessions not
        done within ``timeout`` are cancelled (rolling back). Returns how many sessions
        are left in threads that still run."""
        self.stop()
        cuts = [
            asyncio.ensure_future(self._cut(session, batch))
            for session, batch in list(self._batches.items())
            if not session.done()
        ]
        if cuts:
            await asyncio.wait(cuts, timeout=timeout)
        left_in_threads = 0
        for session in list(self.running):
            if not session.done():
                if session in self.in_threads:
                    left_in_threads += 1
                session.cancel()
        for cut in cuts:
            cut.cancel()
        return left_in_threads

    async def _cut(self, session: asyncio.Task[None], batch: executor.BatchStop) -> None:
        """Until ``session``'s batch is committed: by the session itself (async, or a sync
        one between jobs), or for it (a sync one in its handler)."""
        if session in self.in_threads:
            # Blocking I/O under the batch's lock; in a daemon thread, so that a cut stuck
            # behind the handler's statement does not hold up the process's exit.
            if await _in_daemon_thread(batch.cut, f"skiplock-cut-{id(session):x}"):
                return
        else:
            batch.cut()
        await asyncio.wait({session})

    def producer(
        self,
        queue: str,
        slots: Slots,
        wake: asyncio.Event,
        start: Start,
        *,
        in_thread: bool,
        waiting: WakeupSession | None = None,
    ) -> Producer:
        limits = self.limits
        gate = self.gate

        async def fetch(reservation: Reservation) -> bool:
            batch = self.batch
            await limits.settled()
            governed = queue in limits
            if governed:
                batch = await limits.reserve(queue, batch)
                if batch <= 0:
                    return False
            claimed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            reservation.keep(1)  # the session gives it back when it ends
            stop = executor.BatchStop(self._stopping)
            session = asyncio.create_task(start(claimed, batch, stop, governed))
            self._batches[session] = stop
            session.add_done_callback(self._forget)
            if gate is not None and reservation.take_permit():
                session.add_done_callback(lambda _: gate.release())
            self.running.add(session)
            session.add_done_callback(self.running.discard)
            if in_thread:
                self.in_threads.add(session)
                session.add_done_callback(self.in_threads.discard)
            got = reservation.jobs = await claimed
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
            queue=queue,
            waiting=waiting,
        )

    def _forget(self, session: asyncio.Task[None]) -> None:
        self._batches.pop(session, None)

    def _run(
        self,
        queue: str,
        tasks: list[str],
        limit: int,
        stop: executor.BatchStop,
        governed: bool,
        on_claimed: Callable[[int], None],
        rng: random.Random,
    ) -> executor.TransactionalRun:
        """The batch a session runs, whichever driver runs it."""
        return executor.TransactionalRun(
            self.app,
            queue,
            tasks,
            limit,
            rng=rng,
            governed=governed,
            stop=stop,
            on_claimed=on_claimed,
            on_finished=self.on_finished,
        )

    def async_session(
        self, pool: AsyncConnectionPool[Any], queue: str, tasks: list[str], slots: Slots
    ) -> Start:
        async def session(
            claimed: asyncio.Future[int], batch: int, stop: executor.BatchStop, governed: bool
        ) -> None:
            def on_claimed(n: int) -> None:
                self.on_claimed(queue, n)
                claimed.set_result(n)

            try:
                async with pool.connection() as conn:
                    done = await executor.run_transactional_async(
                        conn,
                        self._run(queue, tasks, batch, stop, governed, on_claimed, self.rng),
                    )
                self.on_completed(done)
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

        def run_in_thread(
            claimed: asyncio.Future[int], batch: int, stop: executor.BatchStop, governed: bool
        ) -> int:
            def on_claimed(n: int) -> None:
                self.on_claimed(queue, n)
                loop.call_soon_threadsafe(claimed.set_result, n)

            with pool.connection() as conn:
                return executor.run_transactional_sync(
                    conn,
                    self._run(queue, tasks, batch, stop, governed, on_claimed, random.Random()),
                )

        async def session(
            claimed: asyncio.Future[int], batch: int, stop: executor.BatchStop, governed: bool
        ) -> None:
            try:
                done = await loop.run_in_executor(
                    threads, run_in_thread, claimed, batch, stop, governed
                )
                self.on_completed(done)
            except Exception as exc:
                if not claimed.done():
                    claimed.set_exception(exc)
                else:
                    log.exception("transactional session on %s failed; rolled back", queue)
            finally:
                slots.give(1)

        return session


def _in_daemon_thread(call: Callable[[], bool], name: str) -> asyncio.Future[bool]:
    """``call`` in a daemon thread; the future gets what it returns (False if it raised)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bool] = loop.create_future()

    def run() -> None:
        result = False
        try:
            result = call()
        except Exception:
            log.exception("%s failed", name)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_resolve, done, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def _resolve(future: asyncio.Future[bool], result: bool) -> None:
    if not future.done():
        future.set_result(result)
