"""The admin API: look at jobs and queues, and change them (docs/admin.md).

``AsyncAdmin`` is written here once; ``Admin``, the same API for sync code, is generated
from this file into admin.py by tools/async_to_sync.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Unpack

import psycopg
from psycopg_pool import AsyncConnectionPool

from skiplock import client, routing
from skiplock.app import App
from skiplock.client.params import JobFilters
from skiplock.errors import ConfigurationError, EnqueueError
from skiplock.tasks import MAX_QUEUE_NAME, check_name
from skiplock.types import Job


class AsyncAdmin:
    """The admin operations of one App's database: cancel, retry and delete jobs; pause,
    resume and limit queues; list jobs, queues and workers. What the CLI and the
    dashboard do, for your own code.

    ``connection`` is a psycopg connection or a psycopg_pool pool of the App's database
    (with ``queue_databases``: the database of the queues and jobs you act on; job ids
    are per database). Each change is one transaction: on a connection with no
    transaction open (autocommit or not) it is committed when the call returns; inside a
    transaction you opened it becomes part of that one, and takes effect when you
    commit. A pool lends a connection for each call and commits before returning it.

    Jobs that are running are never retried or deleted; cancelling one asks its worker
    to stop it. An operation on one job raises JobNotFoundError saying why when it cannot
    be done (no such job, finished, running).
    """

    def __init__(
        self,
        app: App,
        connection: psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any],
    ) -> None:
        if not isinstance(connection, psycopg.AsyncConnection | AsyncConnectionPool):
            raise ConfigurationError(
                f"{type(self).__name__} takes a psycopg.{psycopg.AsyncConnection.__name__} "
                f"or a psycopg_pool.{AsyncConnectionPool.__name__}, "
                f"got {type(connection).__name__}"
            )
        self.app = app
        self._connection = connection

    @property
    def schema(self) -> str:
        return self.app.schema

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if isinstance(self._connection, AsyncConnectionPool):
            async with self._connection.connection() as conn:
                yield conn
        else:
            yield self._connection

    @asynccontextmanager
    async def _change(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection in a transaction of its own (a savepoint in the caller's)."""
        async with self._conn() as conn, conn.transaction():
            yield conn

    # -- jobs ------------------------------------------------------------------------

    async def get_job(self, job_id: int) -> Job:
        """One job by id, live or finished (from history); JobNotFoundError when there is
        none."""
        async with self._conn() as conn:
            return await client.get_job_async(conn, self.schema, job_id)

    async def list_jobs(self, *, limit: int = 100, **filters: Unpack[JobFilters]) -> list[Job]:
        """Live jobs matching every filter given (``state``, ``queue``, ``task``,
        ``older_than`` in seconds since each was enqueued, ``tag`` one of the job's tags),
        by id."""
        async with self._conn() as conn:
            return await client.list_jobs_async(conn, self.schema, limit=limit, **filters)

    async def job_ids(self, **filters: Unpack[JobFilters]) -> list[int]:
        """The ids of every live job matching the filters (those of ``list_jobs``): what
        to pass to retry_jobs, cancel_jobs or delete_jobs to act on all of them. With
        ``state`` "completed" or "cancelled", those of the finished jobs in history:
        retry_jobs runs them again."""
        async with self._conn() as conn:
            return await client.select_job_ids_async(conn, self.schema, **filters)

    async def retry_job(self, job_id: int) -> int:
        """Send a dead or waiting job back to its queue with fresh attempts, to run now;
        a completed or cancelled one (in history) is enqueued again as a copy that names
        it (``meta["replay_of"]``). Returns the id of the job that runs."""
        async with self._change() as conn:
            return await client.retry_job_async(conn, self.schema, job_id)

    async def cancel_job(self, job_id: int) -> None:
        """Cancel a job: a waiting or dead one moves to history as cancelled; a running
        one's worker is asked to stop it, and records it cancelled when it has."""
        async with self._change() as conn:
            await client.cancel_job_async(conn, self.schema, job_id)

    async def delete_job(self, job_id: int) -> None:
        """Remove a job that is not running, leaving no history."""
        async with self._change() as conn:
            await client.delete_job_async(conn, self.schema, job_id)

    async def retry_jobs(self, ids: Sequence[int]) -> int:
        """retry_job for each of ``ids`` that can be; returns how many were."""
        async with self._change() as conn:
            return await client.retry_jobs_async(conn, self.schema, ids)

    async def cancel_jobs(self, ids: Sequence[int]) -> int:
        """cancel_job for each of ``ids`` that can be; returns how many were cancelled or
        asked to stop."""
        async with self._change() as conn:
            return await client.cancel_jobs_async(conn, self.schema, ids)

    async def delete_jobs(self, ids: Sequence[int]) -> int:
        """delete_job for each of ``ids`` that is not running; returns how many were."""
        async with self._change() as conn:
            return await client.delete_jobs_async(conn, self.schema, ids)

    # -- queues and workers ----------------------------------------------------------

    async def _check_queue(self, conn: psycopg.AsyncConnection[Any], queue: str) -> None:
        """A queue's name is valid, and with routes it lives on ``conn``'s database."""
        check_name("queue", queue, MAX_QUEUE_NAME)
        if self.app.queue_databases:
            try:
                await self.app._route_async(conn, [queue])
            except EnqueueError:
                where = routing.describe_url(self.app.database_url_for(queue))
                raise ConfigurationError(
                    f"queue {queue!r} lives on database {where}, not on this "
                    f"{type(self).__name__}'s: give it a connection to that database "
                    f"(app.connect(queue={queue!r}))"
                ) from None

    async def pause_queue(self, queue: str) -> None:
        """Stop claims from ``queue`` (on every worker, from its next claim on); running
        jobs finish."""
        async with self._change() as conn:
            await self._check_queue(conn, queue)
            await client.set_queue_paused_async(conn, self.schema, queue, paused=True)

    async def resume_queue(self, queue: str) -> None:
        """Claim from a paused ``queue`` again; its workers are woken."""
        async with self._change() as conn:
            await self._check_queue(conn, queue)
            await client.set_queue_paused_async(conn, self.schema, queue, paused=False)

    async def set_queue_limits(
        self,
        queue: str,
        *,
        concurrency: int | None = None,
        rate: tuple[int, float] | str | None = None,
    ) -> None:
        """Limit ``queue`` across all workers: at most ``concurrency`` jobs running at
        once, and ``rate`` = (jobs, seconds) or "100/s" started per period. None removes
        that limit (both None: the queue is unlimited). Workers apply it before their
        next claim of the queue."""
        async with self._change() as conn:
            await self._check_queue(conn, queue)
            await client.set_queue_limits_async(
                conn, self.schema, queue, concurrency=concurrency, rate=rate
            )

    async def queue_settings(self) -> list[dict[str, Any]]:
        """The queues that are paused or limited: name, paused, concurrency_limit,
        rate_limit, rate_period."""
        async with self._conn() as conn:
            return await client.list_queues_async(conn, self.schema)

    async def paused_queues(self) -> list[str]:
        """The names of the paused queues."""
        async with self._conn() as conn:
            return await client.paused_queues_async(conn, self.schema)

    async def queue_stats(self) -> list[dict[str, Any]]:
        """Per queue: live jobs by state, the age of the oldest ready job, jobs finished
        in the last minute, and the workers serving it."""
        async with self._conn() as conn:
            return await client.queue_stats_async(conn, self.schema)

    # -- cron schedules --------------------------------------------------------------

    async def schedules(self) -> list[dict[str, Any]]:
        """Every cron schedule a worker has ticked, as it described it: name, expression,
        task, queue, priority, max_attempts, args, missed, last_tick, next_tick, paused."""
        async with self._conn() as conn:
            return await client.list_schedules_async(conn, self.schema)

    async def pause_schedule(self, name: str) -> None:
        """Pause a cron schedule: its ticks pass without jobs (none are owed on resume)."""
        async with self._change() as conn:
            await client.set_schedule_paused_async(conn, self.schema, name, paused=True)

    async def resume_schedule(self, name: str) -> None:
        """Let a paused cron schedule enqueue its ticks again, from its next one."""
        async with self._change() as conn:
            await client.set_schedule_paused_async(conn, self.schema, name, paused=False)

    async def run_schedule_now(self, name: str) -> int:
        """Enqueue a cron schedule's job now, paused or not; returns its id."""
        async with self._change() as conn:
            return await client.run_schedule_now_async(conn, self.schema, name)

    async def workers(self) -> list[dict[str, Any]]:
        """The registered workers: host, pid, queues, concurrency, when last seen, and
        which one leads."""
        async with self._conn() as conn:
            return await client.list_workers_async(conn, self.schema)
