"""The worker's connection pools and handler threads, opened and closed together.

Three pools, so that no duty waits for a connection behind another: claims and outcomes
(``claims``), the leader's duties, promotion and the probe (``maintenance``, every
statement bounded), and sync transactional sessions (``sync``, only when a queue has such
tasks). Every pooled session holds the worker's liveness lock when it may
(worker/liveness.py): the worker lives while any does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any
from uuid import UUID

from psycopg_pool import AsyncConnectionPool, ConnectionPool

from skiplock.pooler import WorkerConnections
from skiplock.sql import claim
from skiplock.worker.liveness import LivenessLock, session_kwargs
from skiplock.worker.options import WorkerOptions
from skiplock.worker.timeouts import MAINTENANCE

# Connections for the maintenance services: at most one each at a time.
MAINTENANCE_POOL_SIZE = 7
# How long a pool keeps retrying one lost connection before it gives up on that attempt
# and grows again when asked. psycopg_pool doubles the wait between tries without a cap
# until then (five minutes by default), so a worker let back in after a minute's outage
# would wait half a minute more for its next try; ended sooner, the tries stay a few
# seconds apart.
POOL_RECONNECT_SECONDS = 10.0


class WorkerPools:
    """``async with WorkerPools(...) as pools``: the pools open on entry, close on exit."""

    def __init__(
        self,
        options: WorkerOptions,
        connections: WorkerConnections,
        worker_id: UUID,
        liveness: LivenessLock,
        *,
        async_sessions: bool,
        sync_sessions: bool,
    ) -> None:
        # A claim per queue, the completer, the cancel reader and the limits, plus a
        # connection per slot when async transactional sessions hold one each.
        size = 4 + len(options.queues) + (options.concurrency if async_sessions else 0)
        self.claims: AsyncConnectionPool[Any] = AsyncConnectionPool(
            connections.url,
            min_size=2,
            max_size=size,
            kwargs=_kwargs(connections.pooled(claim.WORKER_SESSION_OPTIONS), "worker", worker_id),
            configure=liveness,
            open=False,
            name=f"skiplock-{worker_id}",
            reconnect_timeout=POOL_RECONNECT_SECONDS,
        )
        self.maintenance: AsyncConnectionPool[Any] = AsyncConnectionPool(
            connections.url,
            min_size=1,
            max_size=MAINTENANCE_POOL_SIZE,
            kwargs=_kwargs(connections.pooled(MAINTENANCE.options()), "maintenance", worker_id),
            configure=liveness,
            open=False,
            name=f"skiplock-{worker_id}-maintenance",
            reconnect_timeout=POOL_RECONNECT_SECONDS,
        )
        self.sync: ConnectionPool[Any] | None = None
        if sync_sessions:
            self.sync = ConnectionPool(
                connections.url,
                min_size=1,
                max_size=options.concurrency,
                kwargs=_kwargs(connections.pooled(""), "transactional", worker_id),
                configure=liveness.take,
                open=False,
                reconnect_timeout=POOL_RECONNECT_SECONDS,
            )
        self.threads = ThreadPoolExecutor(options.concurrency, thread_name_prefix="skiplock-job")

    async def __aenter__(self) -> WorkerPools:
        if self.sync is not None:
            self.sync.open()
        await self.claims.open()
        await self.maintenance.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.maintenance.close()
        await self.claims.close()
        if self.sync is not None:
            self.sync.close()
        # Sync handlers still running were abandoned by the drain: their threads cannot
        # be stopped, only left behind.
        self.threads.shutdown(wait=False, cancel_futures=True)


def _kwargs(connect: dict[str, Any], purpose: str, worker_id: UUID) -> dict[str, Any]:
    return {"autocommit": True, **connect, **session_kwargs(purpose, worker_id)}
