"""Batched, fenced writes of job outcomes.

Handlers finish one by one; their outcomes are written together, one statement per
outcome kind per flush. A crash before a flush loses only the outcomes, never the jobs:
their leases expire and they run again (at-least-once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb
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
    # The handler's latest set_progress() not yet written: it goes in with the outcome.
    progress_json: str | None = None

    @cached_property
    def kind(self) -> str:
        """completed, retried, dead, snoozed or cancelled: one word for logs and metrics."""
        if self.cancelled:
            return "cancelled"
        if self.snooze:
            return "snoozed"
        if self.error is None:
            return "completed"
        return "dead" if self.dead else "retried"


# One statement per group of outcomes, each over parallel arrays (sql/complete.py).
_STATEMENTS = {
    "completed": complete.JOB_COMPLETE_MANY_IF_LEASED,
    "failed": complete.JOB_FAIL_MANY_IF_LEASED,
    "snoozed": complete.JOB_SNOOZE_MANY_IF_LEASED,
    "cancelled": complete.JOB_CANCEL_MANY_IF_LEASED,
}


def fenced_batch(entries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Parameters of a fenced batch statement: the ids, and each job's own values keyed by
    id (sql/complete.py, ROBUST_LOOKUP)."""
    return {"ids": list(entries), "batch": Jsonb({str(k): v for k, v in entries.items()})}


def outcome_writes(batch: list[Outcome]) -> list[tuple[str, dict[str, Any]]]:
    """The statements (by group) and parameters that write ``batch``; pure."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for outcome in batch:
        kind = outcome.kind
        group = "failed" if kind in ("retried", "dead") else kind
        entry: dict[str, Any] = {"attempt": outcome.attempt, "progress": outcome.progress_json}
        if group == "completed":
            entry["result"] = outcome.result_json
        elif group == "failed":
            entry.update(dead=outcome.dead, delay=outcome.delay, error=outcome.error)
        elif group == "snoozed":
            entry["delay"] = outcome.delay
        groups.setdefault(group, {})[outcome.job_id] = entry
    return [(group, fenced_batch(entries)) for group, entries in groups.items()]


@dataclass
class CompleterStats:
    completed: int = 0
    retried: int = 0
    snoozed: int = 0
    cancelled: int = 0
    dead: int = 0
    refused: int = 0
    dropped: int = 0
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
        self._sql = {group: render(statement, schema) for group, statement in _STATEMENTS.items()}
        self._durable_sql = render(complete.DURABLE_COMMIT_ON, schema)
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
            except psycopg.Error:
                # Not a lost connection: retrying this batch would fail the same way. Drop
                # it; its jobs' leases expire and they run again (at-least-once).
                dropped = self._pending[: self._max_batch]
                del self._pending[: len(dropped)]
                self.stats.dropped += len(dropped)
                log.exception(
                    "could not write %d outcomes; their jobs will run again", len(dropped)
                )

    async def flush(self) -> None:
        """Write everything pending in one transaction. On failure the batch is kept."""
        batch = self._pending[: self._max_batch]
        if not batch:
            self._ready.clear()
            self._drained.set()
            return
        written: set[int] = set()
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(self._durable_sql)
            for group, params in outcome_writes(batch):
                cur = await conn.execute(self._sql[group], {**params, "worker_id": self._worker_id})
                written.update(r[0] for r in await cur.fetchall())
            # One wake-up per flush for anyone awaiting a result (client.wait_for_result).
            await conn.execute(self._done_sql, {"channel": self._done_channel})
        del self._pending[: len(batch)]
        self.stats.flushes += 1
        self._on_flush(len(batch), len(batch) - len(written))
        if any(o.kind == "retried" or (o.kind == "snoozed" and o.delay > 0) for o in batch):
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
            else:
                kind = outcome.kind
                setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        if not self._pending:
            self._ready.clear()
            self._drained.set()
