"""Keeping the history table's size bounded: partitions ahead, expired ones dropped.

Runs on the elected leader (and from ``skiplock prune``). Each step commits on its own.
Partitions are created and dropped through the schema owner's functions (0012), so the
worker's role needs EXECUTE on them, not ownership (see skiplock.grants).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from skiplock.sql import history, keys, render, signals, steps

log = logging.getLogger("skiplock.history")

DAYS_AHEAD = 3
_NAME = re.compile(r"^job_history_p(\d{8})$")
DDL_LOCK_TIMEOUT_MS = "1000"
PRUNE_BATCH = 5000


@dataclass
class HistoryReport:
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    pruned_rows: int = 0
    pruned_workflows: int = 0
    pruned_steps: int = 0
    expired_windows: int = 0
    expired_signals: int = 0
    skipped: list[str] = field(default_factory=list)


def partition_name(day: date) -> str:
    return f"job_history_p{day:%Y%m%d}"


def partition_day(name: str) -> date | None:
    """The day a partition holds, from its name; None for DEFAULT and foreign tables."""
    match = _NAME.match(name)
    if not match:
        return None
    try:
        return datetime.strptime(match[1], "%Y%m%d").date()
    except ValueError:
        return None


def plan(
    existing: list[str],
    now: datetime,
    retention: timedelta | None,
    days_ahead: int = DAYS_AHEAD,
) -> tuple[list[date], list[str]]:
    """Days to create partitions for, and partitions to drop; pure.

    A partition is dropped once everything it can hold (up to the end of its day) is
    older than the retention.
    """
    today = now.astimezone(UTC).date()
    have = set(existing)
    create = [
        today + timedelta(days=n)
        for n in range(days_ahead + 1)
        if partition_name(today + timedelta(days=n)) not in have
    ]
    drop = []
    if retention is not None:
        cutoff = now - retention
        for name in existing:
            day = partition_day(name)
            if day is not None:
                ends = datetime(day.year, day.month, day.day, tzinfo=UTC)
                if ends + timedelta(days=1) <= cutoff:
                    drop.append(name)
    return create, drop


def maintain(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    retention: timedelta | None,
    now: datetime | None = None,
) -> HistoryReport:
    """Create partitions ahead, drop expired ones, prune the DEFAULT partition, the
    workflows that ended before the retention and the durable steps of jobs that did,
    and delete unique windows that have passed and signals that expired unread.

    ``conn`` must be in autocommit mode. ``retention`` None keeps history forever.
    """
    report = HistoryReport()
    table = f'"{schema}".job_history'
    rows = conn.execute(render(history.HISTORY_PARTITIONS, schema), {"history": table}).fetchall()
    existing = [str(r[0]) for r in rows]
    if now is None:
        row = conn.execute("SELECT now()").fetchone()
        assert row is not None
        now = row[0]
    assert now is not None
    create, drop = plan(existing, now, retention)
    create_partition = render(history.HISTORY_PARTITION_CREATE, schema)
    for day in create:
        name = partition_name(day)
        if _ddl(conn, create_partition, day, name, report):
            report.created.append(name)
    drop_partition = render(history.HISTORY_PARTITION_DROP, schema)
    for name in drop:
        dropped_day = partition_day(name)
        assert dropped_day is not None  # plan drops only partitions named for their day
        if _ddl(conn, drop_partition, dropped_day, name, report):
            report.dropped.append(name)
    if retention is not None:
        prune = sql.SQL(history.HISTORY_PRUNE_DEFAULT_BATCH).format(
            history_default=sql.Identifier(schema, "job_history_default")
        )
        report.pruned_rows += _in_batches(
            conn, prune, {"retention": retention.total_seconds(), "batch": PRUNE_BATCH, "now": now}
        )
        workflows = render(history.WORKFLOWS_PRUNE_BATCH, schema)
        while True:
            row = conn.execute(
                workflows, {"ended_before": now - retention, "batch": PRUNE_BATCH}
            ).fetchone()
            pruned = int(row[0]) if row else 0
            report.pruned_workflows += pruned
            if pruned < PRUNE_BATCH:
                break
        report.pruned_steps += _in_batches(
            conn,
            render(steps.STEPS_PRUNE, schema),
            {"before": now - retention, "limit": PRUNE_BATCH},
        )
    conn.execute(render(keys.KEY_RATES_PRUNE, schema))
    report.expired_windows += _in_batches(
        conn, render(history.UNIQUE_WINDOWS_PRUNE_BATCH, schema), {"batch": PRUNE_BATCH}
    )
    report.expired_signals += _in_batches(
        conn, render(signals.SIGNALS_PRUNE, schema), {"limit": PRUNE_BATCH}
    )
    return report


def _in_batches(
    conn: psycopg.Connection[Any], statement: str | sql.Composed, params: dict[str, Any]
) -> int:
    """Run a delete of at most PRUNE_BATCH rows until one deletes fewer; rows deleted.
    Each batch commits alone (autocommit), so no transaction holds many row locks."""
    deleted = 0
    while True:
        cur = conn.execute(statement, params)
        deleted += cur.rowcount
        if cur.rowcount < PRUNE_BATCH:
            return deleted


def _ddl(
    conn: psycopg.Connection[Any], statement: str, day: date, name: str, report: HistoryReport
) -> bool:
    try:
        with conn.transaction():
            conn.execute(history.HISTORY_LOCK_TIMEOUT, {"ms": DDL_LOCK_TIMEOUT_MS})
            conn.execute(statement, {"day": day})
        return True
    except (psycopg.errors.LockNotAvailable, psycopg.errors.CheckViolation) as exc:
        # LockNotAvailable: a long transaction holds job_history; try again later.
        # CheckViolation: rows for that day already sit in DEFAULT; they are pruned there.
        log.warning("history partition %s skipped: %s", name, str(exc).strip())
        report.skipped.append(name)
        return False
