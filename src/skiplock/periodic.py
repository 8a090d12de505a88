"""Periodic (cron) tasks: the registry entry and the enqueue of due ticks.

Every worker enqueues the due ticks of the schedules its own App defines (decision 021),
so a schedule ticks while any live worker that defines it runs, whichever worker leads
and whichever other services share the schema. Each tick is enqueued once however many
workers try: advancing the schedule's last tick is a compare-and-set in the transaction
that inserts the tick's job.
"""

from __future__ import annotations

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
    last_ticks: dict[str, datetime | None] = {str(row[0]): row[1] for row in rows}
    if now is None:
        now = rows[0][2]
    assert now is not None
    enqueued = 0
    for entry in entries:
        last = last_ticks.get(entry.name)
        ticks, new_last = due_ticks(entry.schedule, last, now, entry.missed)
        if last is None:
            await conn.execute(
                render(periodic_sql.PERIODIC_START, schema), {"name": entry.name, "tick": now}
            )
            continue
        if new_last == last:
            continue
        try:
            async with conn.transaction():
                cur = await conn.execute(
                    render(periodic_sql.PERIODIC_ADVANCE, schema),
                    {"name": entry.name, "tick": new_last, "expected": last},
                )
                if await cur.fetchone() is None:
                    continue  # another worker took these ticks
                call = entry.task.with_options()
                added = 0
                for tick in ticks:
                    spec = call.with_options(run_at=tick).job(**entry.args)
                    await client.insert_job_async(conn, schema, spec)
                    added += 1
            enqueued += added
        except psycopg.errors.LockNotAvailable:
            # A transaction holds a key or row this schedule's job needs (the worker's
            # maintenance connections bound lock waits): its ticks wait for the next
            # pass, rolled back with the advance; the other schedules go on.
            log.warning("periodic %s: a lock it needs is held; its ticks wait", entry.name)
    next_tick = min((entry.schedule.next_after(now) for entry in entries), default=None)
    return CronPass(enqueued, now, next_tick)
