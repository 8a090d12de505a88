"""Periodic (cron) tasks: the registry entry and the enqueue of due ticks.

Every worker enqueues the due ticks of the schedules its own App defines (decision 021),
so a schedule ticks while any live worker that defines it runs, whichever worker leads
and whichever other services share the schema. Each tick is enqueued once however many
workers try: advancing the schedule's last tick is a compare-and-set in the transaction
that inserts the tick's job.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg

from skiplock import client
from skiplock.cron import CronSchedule, due_ticks
from skiplock.sql import periodic as periodic_sql
from skiplock.sql import render
from skiplock.tasks import Task

if TYPE_CHECKING:
    from skiplock.app import App

log = logging.getLogger("skiplock.periodic")


@dataclass(frozen=True)
class Periodic:
    """A task enqueued on a cron schedule with fixed arguments."""

    task: Task[Any]
    schedule: CronSchedule
    args: dict[str, Any]
    missed: str

    @property
    def name(self) -> str:
        return self.task.name


@dataclass(frozen=True)
class CronPass:
    """What one pass did: jobs enqueued, and the database's clock and the earliest tick
    of these schedules after it (None without schedules), so the caller can sleep until
    then."""

    enqueued: int
    now: datetime
    next_tick: datetime | None

    @property
    def seconds_to_next_tick(self) -> float | None:
        if self.next_tick is None:
            return None
        return max((self.next_tick - self.now).total_seconds(), 0.0)


async def enqueue_due(
    conn: psycopg.AsyncConnection[Any], app: App, now: datetime | None = None
) -> int:
    """Enqueue every tick of ``app``'s schedules that has come due, each exactly once
    across all workers; returns the jobs this call enqueued (see tick_due)."""
    return (await tick_due(conn, app, now)).enqueued


async def tick_due(
    conn: psycopg.AsyncConnection[Any], app: App, now: datetime | None = None
) -> CronPass:
    """One pass over ``app``'s schedules: one read of their last ticks, then one
    transaction per schedule that has a tick due.

    ``now`` defaults to the database's clock (the same for every host); tests pass one.
    ``conn`` must be in autocommit mode: each schedule advances in its own transaction.
    """
    schema = app.schema
    entries = list(app.periodics.values())
    cur = await conn.execute(
        render(periodic_sql.PERIODIC_GET_MANY, schema),
        {"names": [entry.name for entry in entries] or [""]},
    )
    rows = await cur.fetchall()
    stored = {str(row[0]): row for row in rows}
    if now is None:
        now = rows[0][2]
    assert now is not None
    enqueued = 0
    for entry in entries:
        row = stored.get(entry.name)
        last, paused = (row[1], bool(row[3])) if row is not None else (None, False)
        ticks, new_last = due_ticks(entry.schedule, last, now, entry.missed)
        described = _description(entry, _next_tick(entry, max(now, new_last or now)))
        params = {"name": entry.name, **described}
        if last is None:
            await conn.execute(render(periodic_sql.PERIODIC_START, schema), {**params, "tick": now})
            continue
        if new_last == last:
            if row is not None and _stored_description(row) != _comparable(described):
                await conn.execute(render(periodic_sql.PERIODIC_DESCRIBE, schema), params)
            continue
        assert new_last is not None
        enqueued += await _advance(conn, schema, entry, params, ticks, new_last, last, paused)
    next_tick = min((entry.schedule.next_after(now) for entry in entries), default=None)
    return CronPass(enqueued, now, next_tick)


async def _advance(
    conn: psycopg.AsyncConnection[Any],
    schema: str,
    entry: Periodic,
    params: dict[str, Any],
    ticks: list[datetime],
    new_last: datetime,
    last: datetime,
    paused: bool,
) -> int:
    """Move ``entry``'s last tick from ``last`` to ``new_last`` and enqueue ``ticks``'
    jobs, in one transaction; returns how many. Another worker that moved it first wins.
    A paused schedule moves on without jobs: its ticks are skipped, not owed."""
    try:
        async with conn.transaction():
            cur = await conn.execute(
                render(periodic_sql.PERIODIC_ADVANCE, schema),
                {**params, "tick": new_last, "expected": last},
            )
            if await cur.fetchone() is None:
                return 0  # another worker took these ticks
            if paused:
                log.info("periodic %s is paused: %d tick(s) skipped", entry.name, len(ticks))
                return 0
            call = entry.task.with_options()
            for tick in ticks:
                spec = call.with_options(run_at=tick).job(**entry.args)
                await client.insert_job_async(conn, schema, spec)
            return len(ticks)
    except psycopg.errors.LockNotAvailable:
        # A transaction holds a key or row this schedule's job needs (the worker's
        # maintenance connections bound lock waits): its ticks wait for the next pass,
        # rolled back with the advance; the other schedules go on.
        log.warning("periodic %s: a lock it needs is held; its ticks wait", entry.name)
        return 0


def _next_tick(entry: Periodic, after: datetime) -> datetime | None:
    """The schedule's first tick after ``after``; None past what datetime holds (a last
    tick written by hand in year 9999)."""
    try:
        return entry.schedule.next_after(after)
    except (OverflowError, ValueError):
        return None


def _description(entry: Periodic, next_tick: datetime | None) -> dict[str, Any]:
    """What PERIODIC_START, _ADVANCE and _DESCRIBE write of ``entry`` (migrations 0030,
    0033)."""
    spec = entry.task.with_options().job(**entry.args)
    return {
        "expression": entry.schedule.expression,
        "task": spec.task,
        "queue": spec.queue,
        "priority": spec.priority,
        "max_attempts": spec.max_attempts,
        "args": spec.args_json,
        "missed": entry.missed,
        "next_tick": next_tick,
        "tags": list(spec.tags) or None,
    }


def _comparable(described: dict[str, Any]) -> dict[str, Any]:
    """A description with its arguments parsed: jsonb orders keys its own way."""
    return {**described, "args": json.loads(described["args"])}


def _stored_description(row: Any) -> dict[str, Any]:
    """The description as PERIODIC_GET_MANY read it, as _comparable gives it."""
    expression, task, queue, priority, max_attempts, args, missed, next_tick, tags = row[4:13]
    return {
        "expression": expression,
        "task": task,
        "queue": queue,
        "priority": priority,
        "max_attempts": max_attempts,
        "args": args,
        "missed": missed,
        "next_tick": next_tick,
        "tags": tags,
    }
