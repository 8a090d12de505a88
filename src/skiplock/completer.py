"""Batched, fenced writes of job outcomes.

Handlers finish one by one; their outcomes are written together, one statement per
outcome kind per flush. A crash before a flush loses only the outcomes, never the jobs:
their leases expire and they run again (at-least-once).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg
from psycopg_pool import AsyncConnectionPool

from skiplock.config import done_channel
from skiplock.retry import RetryPolicy
from skiplock.sql import complete, render

log = logging.getLogger("skiplock.completer")

RECONNECT = RetryPolicy(base=0.05, factor=2.0, cap=2.0, jitter=0.5)


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to. ``error`` is set exactly when the attempt failed."""

    job_id: int
    attempt: int
    result_json: str | None = None
    error: dict[str, Any] | None = None
    dead: bool = False
    delay: float = 0.0
    snooze: bool = False
    cancelled: bool = False


@dataclass
class CompleterStats:
    completed: int = 0
    retried: int = 0
    snoozed: int = 0
    cancelled: int = 0
    dead: int = 0
    refused: int = 0
    flushes: int = 0


class Completer:
    """Collects outcomes and writes them every ``interval`` seconds or ``max_batch`` items."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        schema: str,
        worker_id: UUID,
        *,
        interval: float = 0.002,
        max_batch: int = 2000,
        on_retry_written: Callable[[], None] = lambda: None,
        on_flush: Callable[[int, int], None] = lambda batch, refused: None,
    ) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._interval = interval
        self._max_batch = max_batch
        self._on_retry_written = on_retry_written
        self._on_flush = on_flush
        self._complete_sql = render(complete.JOB_COMPLETE_MANY_IF_LEASED, schema)
        self._fail_sql = render(complete.JOB_FAIL_MANY_IF_LEASED, schema)
        self._durable_sql = render(complete.DURABLE_COMMIT_ON, schema)
        self._snooze_sql = render(complete.JOB_SNOOZE_MANY_IF_LEASED, schema)
        self._cancel_sql = render(complete.JOB_CANCEL_MANY_IF_LEASED, schema)
        self._done_sql = render(complete.JOBS_DONE_NOTIFY, schema)
        self._done_channel = done_channel(schema)
        self._pending: list[Outcome] = []
        self._ready = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self.stats = CompleterStats()
        self.refused_ids: list[int] = []

    def add(self, outcome: Outcome) -> None:
        self._pending.append(outcome)
        self._drained.clear()
        self._ready.set()

    @property
    def backlog(self) -> int:
        return len(self._pending)

    async def wait_drained(self) -> None:
        await self._drained.wait()

    async def run(self) -> None:
        """Flush until cancelled. Waits a moment after the first outcome to gather more."""
        failures = 0
        import random  # noqa: PLC0415

        rng = random.Random()
        while True:
            await self._ready.wait()
            if len(self._pending) < self._max_batch:
                await asyncio.sleep(self._interval)
            try:
                await self.flush()
                failures = 0
            except psycopg.OperationalError as exc:
                failures += 1
                delay = RECONNECT.delay(failures, rng)
                log.warning("writing outcomes failed (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)

    async def flush(self) -> None:
        """Write everything pending in one transaction. On failure the batch is kept."""
        batch = self._pending[: self._max_batch]
        if not batch:
            self._ready.clear()
            self._drained.set()
            return
        done = [o for o in batch if o.error is None and not o.snooze and not o.cancelled]
        failed = [o for o in batch if o.error is not None and not o.cancelled]
        snoozed = [o for o in batch if o.snooze]
        cancelled = [o for o in batch if o.cancelled]
        written: set[int] = set()
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(self._durable_sql)
            if done:
                cur = await conn.execute(
                    self._complete_sql,
                    {
                        "ids": [o.job_id for o in done],
                        "attempts": [o.attempt for o in done],
                        "results": [o.result_json for o in done],
                        "worker_id": self._worker_id,
                    },
                )
                written.update(r[0] for r in await cur.fetchall())
            if failed:
                cur = await conn.execute(
                    self._fail_sql,
                    {
                        "ids": [o.job_id for o in failed],
                        "attempts": [o.attempt for o in failed],
                        "dead": [o.dead for o in failed],
                        "delays": [o.delay for o in failed],
                        "errors": [json.dumps(o.error) for o in failed],
                        "worker_id": self._worker_id,
                    },
                )
                written.update(r[0] for r in await cur.fetchall())
            if snoozed:
                cur = await conn.execute(
                    self._snooze_sql,
                    {
                        "ids": [o.job_id for o in snoozed],
                        "attempts": [o.attempt for o in snoozed],
                        "delays": [o.delay for o in snoozed],
                        "worker_id": self._worker_id,
                    },
                )
                written.update(r[0] for r in await cur.fetchall())
            if cancelled:
                cur = await conn.execute(
                    self._cancel_sql,
                    {
                        "ids": [o.job_id for o in cancelled],
                        "attempts": [o.attempt for o in cancelled],
                        "worker_id": self._worker_id,
                    },
                )
                written.update(r[0] for r in await cur.fetchall())
            # One wake-up per flush for anyone awaiting a result (client.wait_for_result).
            await conn.execute(self._done_sql, {"channel": self._done_channel})
        del self._pending[: len(batch)]
        self.stats.flushes += 1
        self._on_flush(len(batch), len(batch) - len(written))
        if any(o.delay > 0 and not o.dead for o in failed + snoozed):
            self._on_retry_written()
        for outcome in batch:
            if outcome.job_id not in written:
                self.stats.refused += 1
                self.refused_ids.append(outcome.job_id)
                log.warning(
                    "refused stale outcome for job %s attempt %s: lease lost, job was rescued",
                    outcome.job_id,
                    outcome.attempt,
                )
            elif outcome.cancelled:
                self.stats.cancelled += 1
            elif outcome.snooze:
                self.stats.snoozed += 1
            elif outcome.error is None:
                self.stats.completed += 1
            elif outcome.dead:
                self.stats.dead += 1
            else:
                self.stats.retried += 1
        if not self._pending:
            self._ready.clear()
            self._drained.set()
