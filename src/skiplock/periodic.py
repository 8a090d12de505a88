"""Periodic (cron) tasks: the registry entry and the leader's enqueue of due ticks."""

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


async def enqueue_due(
    conn: psycopg.AsyncConnection[Any], app: App, now: datetime | None = None
) -> int:
    """Enqueue every tick that has come due, each exactly once; returns jobs enqueued.

    ``now`` defaults to the database's clock (the same for every host); tests pass one.
    ``conn`` must be in autocommit mode: each schedule advances in its own transaction.
    """
    schema = app.schema
    if now is None:
        cur = await conn.execute(render(periodic_sql.PERIODIC_NOW, schema))
        row = await cur.fetchone()
        assert row is not None
        now = row[0]
    assert now is not None
    enqueued = 0
    for entry in app.periodics.values():
        cur = await conn.execute(render(periodic_sql.PERIODIC_GET, schema), {"name": entry.name})
        row = await cur.fetchone()
        last = row[0] if row else None
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
                    continue  # another leader took these ticks
                call = entry.task.with_options()
                added = 0
                for tick in ticks:
                    spec = call.with_options(run_at=tick).job(**entry.args)
                    await client.insert_job_async(conn, schema, spec)
                    added += 1
            enqueued += added
        except psycopg.errors.LockNotAvailable:
            # A transaction holds a key or row this schedule's job needs (the leader's
            # connections bound lock waits): its ticks wait for the next pass, rolled back
            # with the advance; the other schedules go on.
            log.warning("periodic %s: a lock it needs is held; its ticks wait", entry.name)
    return enqueued
