"""Starting, restarting and counting the worker's services.

A service is anything with a ``name`` and an async ``run`` that runs until cancelled.
Failures it expects (a lost connection, a lock timeout) it handles itself; anything else
escapes ``run`` and reaches the supervisor, which logs the traceback, counts a restart of
that service, and starts it again after a back-off. So no duty dies silently, and none
takes another down with it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import psycopg

from skiplock.retry import RetryPolicy

log = logging.getLogger("skiplock.worker.supervisor")

RESTART = RetryPolicy(base=0.1, factor=2.0, cap=10.0, jitter=0.5)
# How long a stop waits for a cancelled service before it cancels it again.
CANCEL_AGAIN_SECONDS = 0.1
# A service that ran this long before it failed was healthy: its back-off starts over.
HEALTHY_SECONDS = 60.0


class Service(Protocol):
    name: str

    async def run(self) -> None:
        """Do the service's duty until cancelled."""


class Supervisor:
    """Runs each service as a task and restarts it, with back-off, when it raises.

    ``restarts`` counts the restarts per service name; ``on_restart`` is told of each (the
    worker reports them as a metric).
    """

    def __init__(
        self,
        *,
        policy: RetryPolicy = RESTART,
        on_restart: Callable[[str], None] = lambda name: None,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self.restarts: dict[str, int] = {}
        self._on_restart = on_restart
        self._rng = rng or random.Random()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Services asked to stop: one that raises now is not started again.
        self._stopping: set[str] = set()

    def start(self, service: Service) -> None:
        if service.name in self._tasks:
            raise ValueError(f"a service named {service.name!r} is already running")
        self.restarts.setdefault(service.name, 0)
        self._stopping.discard(service.name)
        self._tasks[service.name] = asyncio.create_task(
            self._keep(service), name=f"skiplock-{service.name}"
        )

    def running(self, name: str) -> bool:
        task = self._tasks.get(name)
        return task is not None and not task.done()

    async def stop(self, names: Iterable[str] | None = None) -> None:
        """Cancel the named services (all when None) and wait until they have ended.

        The cancellation is repeated until each has ended: on Python 3.11 a single one can
        be lost (CPython gh-86296: ``asyncio.wait_for`` returns the result instead of
        raising when the cancel and the result arrive in the same loop step), and
        psycopg_pool waits for a free connection that way. A service cancelled just as the
        pool handed it a connection then runs on, and a stop that cancelled once would wait
        for ever."""
        chosen = list(self._tasks) if names is None else list(names)
        tasks = {task for name in chosen if (task := self._tasks.pop(name, None)) is not None}
        self._stopping.update(chosen)
        pending = tasks
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_SECONDS)
            if pending:
                log.debug("cancelling %d services again", len(pending))
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "service %s ended with an error at stop",
                    task.get_name(),
                    exc_info=task.exception(),
                )

    async def _keep(self, service: Service) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            started = loop.time()
            try:
                await service.run()
            except Exception:
                if service.name in self._stopping:
                    raise  # asked to stop (its cancel was lost): not started again
                if loop.time() - started >= HEALTHY_SECONDS:
                    failures = 0
                failures += 1
                self.restarts[service.name] += 1
                delay = self.policy.delay(failures, self._rng)
                log.exception(
                    "service %s failed; restarting it in %.2fs (restart %d)",
                    service.name,
                    delay,
                    self.restarts[service.name],
                )
                try:
                    self._on_restart(service.name)
                except Exception:
                    log.exception("reporting the restart of %s failed", service.name)
                await asyncio.sleep(delay)
            else:
                log.debug("service %s ended", service.name)
                return


# A failure that repeats pass after pass is logged again at most this often.
REPEAT_WARNING_SECONDS = 60.0


class PeriodicService:
    """A service made of passes: ``run_once`` does one, ``pause`` waits for the next.

    A pass that fails on the database (a lost connection, a lock or statement timeout)
    only ends that pass: it is logged at WARNING (a repeat at most once a minute) and the
    next pass runs as planned. Anything else escapes to the supervisor.
    """

    name: str = "periodic"
    log = log

    async def run_once(self) -> None:
        raise NotImplementedError

    async def pause(self) -> None:
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        """Told of each pass the database ended (before it is logged)."""

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        warned_at = float("-inf")
        while True:
            try:
                await self.run_once()
            except psycopg.OperationalError as exc:
                failures += 1
                self.failed(exc)
                now = loop.time()
                repeat = now - warned_at < REPEAT_WARNING_SECONDS
                if not repeat:
                    warned_at = now
                self.log.log(
                    logging.DEBUG if repeat else logging.WARNING,
                    "%s: pass failed (%s); will retry",
                    self.name,
                    describe(exc),
                )
            else:
                if failures:
                    self.log.info("%s: working again after %d failed passes", self.name, failures)
                failures = 0
                warned_at = float("-inf")
            await self.pause()


def describe(exc: BaseException) -> str:
    """One line for a log: lock and statement timeouts by name, others by their text."""
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return "lock timeout: a transaction holds a row or key it needs"
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return "statement timeout"
    return str(exc).strip() or type(exc).__name__


class Loop:
    """A service from a name and a coroutine function that runs until cancelled."""

    def __init__(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self._run = run

    async def run(self) -> None:
        await self._run()


class Every(PeriodicService):
    """A service that awaits ``step`` every ``interval`` seconds, the first after one."""

    def __init__(self, name: str, interval: float, step: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self._interval = interval
        self._step = step

    async def run(self) -> None:
        await self.pause()
        await super().run()

    async def run_once(self) -> None:
        await self._step()

    async def pause(self) -> None:
        await asyncio.sleep(self._interval)
