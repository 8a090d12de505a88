"""One worker process serving queues on several databases: a ``Worker`` per database,
composed on one event loop (decision 020, docs/routing.md).

Each database keeps everything a single-database worker has there: its own pools, its
own listener and liveness lock, and its own share in that database's leader election,
rescue and history; each Worker ticks the schedules of the queues on its database.
Nothing is shared across databases but the process, its signals and its shutdown:
concurrency is per database URL.

Which URLs reach one database is asked of the servers (routing.DATABASE_IDENTITY), not
read from the URLs' text: a routing table that names the default database again under
another spelling gives two Workers on one database, and each of them ticks the schedules
of every queue on that database (decision 021; each tick is still enqueued once).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Any

import psycopg

from skiplock.app import App
from skiplock.errors import ConfigurationError
from skiplock.routing import Identity, describe_url, same_database_urls, url_identity_async
from skiplock.worker.supervisor import describe
from skiplock.worker.worker import Worker

log = logging.getLogger("skiplock.worker")

# Learning which URLs reach one database must not hold up a start: a database that does
# not answer by then keeps the schedules its URL's text gives it (its Worker waits for it
# as usual).
IDENTITY_TIMEOUT_SECONDS = 10.0


class RoutedWorker:
    """Runs ``queues`` of an App with routes (``App(queue_databases=...)``): one Worker
    per database URL that holds any of them, each with ``concurrency`` slots of its own.
    Other keyword options are every Worker's."""

    def __init__(self, app: App, *, queues: Sequence[str], **options: Any) -> None:
        if not queues:
            raise ConfigurationError("a worker needs at least one queue")
        self.app = app
        self._stop_requested = False
        self.workers = [
            Worker(app._for_database(url), queues=served, **options)
            for url, served in app.queues_by_database(queues).items()
        ]

    @property
    def abandoned_threads(self) -> int:
        return sum(worker.abandoned_threads for worker in self.workers)

    @property
    def ready(self) -> bool:
        """Every database's worker has started."""
        return all(worker.ready.is_set() for worker in self.workers)

    def run(self) -> None:
        """Run until SIGTERM or SIGINT, then shut every database's worker down gracefully."""
        asyncio.run(self.run_async(handle_signals=True))

    def request_stop(self) -> None:
        """Ask every worker to stop; safe from any thread."""
        self._stop_requested = True  # before the workers start: they never do
        for worker in self.workers:
            worker.request_stop()

    async def run_async(self, *, handle_signals: bool = False) -> None:
        """Run the workers together. When one of them fails (its database lacks a
        migration, say), the others are stopped and its error is raised."""
        for worker in self.workers:
            log.info(
                "serving %s on %s",
                ", ".join(worker.queues),
                describe_url(worker.app.database_url),
            )
        await self._share_schedules()
        if self._stop_requested:
            return
        tasks = [asyncio.ensure_future(worker.run_async()) for worker in self.workers]
        # Each run_async sets up its stop event before its first await: after this yield
        # every worker can take a signal.
        await asyncio.sleep(0)
        if handle_signals:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._on_signal, signum)
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if any(not task.cancelled() and task.exception() is not None for task in done):
            self.request_stop()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _share_schedules(self) -> None:
        """Give each Worker the periodic tasks of every queue whose database is its own
        under any URL: the routing table's URLs are compared by what their servers say."""
        urls = self.app.databases()
        if len(urls) < 2:
            return
        identities = dict(
            zip(urls, await asyncio.gather(*(self._identity(url) for url in urls)), strict=True)
        )
        same = same_database_urls(identities)
        for worker in self.workers:
            url = worker.app.database_url
            for name, periodic in self.app.periodics.items():
                if self.app.database_url_for(periodic.task.options.queue) in same[url]:
                    worker.app.periodics.setdefault(name, periodic)

    @staticmethod
    async def _identity(url: str) -> Identity | None:
        try:
            return await asyncio.wait_for(
                url_identity_async(url, connect_timeout=int(IDENTITY_TIMEOUT_SECONDS)),
                IDENTITY_TIMEOUT_SECONDS,
            )
        except (psycopg.Error, TimeoutError) as exc:
            log.warning(
                "could not ask %s which database it is (%s); its schedules stay with its URL",
                describe_url(url),
                describe(exc),
            )
            return None

    def _on_signal(self, signum: int) -> None:
        # Worker._on_signal: the first signal stops claiming, a second releases jobs now.
        for worker in self.workers:
            worker._on_signal(signum)
