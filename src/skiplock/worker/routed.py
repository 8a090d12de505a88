"""One worker process serving queues on several databases: a ``Worker`` per database,
composed on one event loop (decision 020, docs/routing.md).

Each database keeps everything a single-database worker has there: its own pools, its
own listener and liveness lock, and its own share in that database's leader election,
rescue, history and cron. Nothing is shared across databases but the process, its
signals and its shutdown: concurrency is per database.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Any

from skiplock.app import App
from skiplock.errors import ConfigurationError
from skiplock.routing import describe_url
from skiplock.worker.worker import Worker

log = logging.getLogger("skiplock.worker")


class RoutedWorker:
    """Runs ``queues`` of an App with routes (``App(queue_databases=...)``): one Worker
    per database that holds any of them, each with ``concurrency`` slots of its own.
    Other keyword options are every Worker's."""

    def __init__(self, app: App, *, queues: Sequence[str], **options: Any) -> None:
        if not queues:
            raise ConfigurationError("a worker needs at least one queue")
        self.app = app
        self.workers = [
            Worker(app.for_database(url), queues=served, **options)
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

    def _on_signal(self, signum: int) -> None:
        # Worker._on_signal: the first signal stops claiming, a second releases jobs now.
        for worker in self.workers:
            worker._on_signal(signum)
