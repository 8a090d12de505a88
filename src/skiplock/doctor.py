"""``skiplock doctor``: checks that explain themselves and say what to do.

Each check returns Findings; ``warn`` means worth a look, ``fail`` means the queue is (or
soon will be) in trouble. The SQL behind each lives in sql/doctor.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from skiplock import history, pooler
from skiplock.migrate import pending_migrations
from skiplock.sql import doctor as q
from skiplock.sql import history as history_sql
from skiplock.sql import render
from skiplock.wording import plural

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # ok, warn, fail
    message: str
    fix: str = ""


@dataclass(frozen=True)
class Limits:
    """Thresholds; defaults suit a queue that should drain within minutes."""

    long_transaction_seconds: float = 300.0
    dead_tuples: int = 100_000
    notify_queue_usage: float = 0.5
    stale_worker_seconds: float = 120.0
    transactional_job_seconds: float = 60.0


def check_migrations(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    pending = pending_migrations(conn, schema)
    if pending:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in pending)
        return [Finding("migrations", "fail", f"pending: {names}", "run `skiplock migrate`")]
    return [Finding("migrations", "ok", "schema is at the latest version")]


def check_autovacuum(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    found = []
    row = conn.execute(q.DOCTOR_AUTOVACUUM).fetchone()
    if row is None or row[0] != "on":
        found.append(
            Finding(
                "autovacuum",
                "fail",
                "autovacuum is off for the whole server",
                "set autovacuum = on in postgresql.conf: the queue tables churn constantly",
            )
        )
    rows = conn.execute(render(q.DOCTOR_TABLES, schema), {"schema": schema}).fetchall()
    for name, disabled, live, dead, last_auto, _last_manual in rows:
        if disabled:
            found.append(
                Finding(
                    "autovacuum",
                    "fail",
                    f"autovacuum is disabled on {schema}.{name}",
                    f"ALTER TABLE {schema}.{name} RESET (autovacuum_enabled)",
                )
            )
        if dead is not None and dead > limits.dead_tuples:
            found.append(
                Finding(
                    "dead tuples",
                    "warn",
                    f"{schema}.{name} has {dead:,} dead row versions ({live or 0:,} live); "
                    f"last autovacuum {last_auto or 'never'}",
                    "if an old transaction is open (see below) end it; otherwise check that "
                    "autovacuum keeps up (autovacuum_max_workers, cost limits)",
                )
            )
    if not found:
        found.append(Finding("autovacuum", "ok", "on, and the queue tables are being vacuumed"))
    return found


def check_horizon(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    found = []
    row = conn.execute(q.DOCTOR_OLDEST_XMIN, {"limit": limits.long_transaction_seconds}).fetchone()
    if row is not None and row[4] is not None:
        pid, user, app, state, seconds, age, query, wrote, has_snapshot = row
        # A session idle in its transaction after a write holds its xid, not a snapshot.
        holds = (
            f"has held a snapshot for {seconds:.0f}s (xmin age {age})"
            if has_snapshot
            else f"wrote in a transaction open for {seconds:.0f}s and holds its transaction "
            f"id with no snapshot (xid age {age})"
        )
        if wrote and has_snapshot:
            holds += ", and has written"
        found.append(
            Finding(
                "oldest transaction",
                "warn",
                f"pid {pid} ({user}, {app or 'no application_name'}, {state}) {holds}: "
                f"VACUUM cannot clean up behind it. Last query: {query!r}",
                f"end it if it is stuck: SELECT pg_terminate_backend({pid})",
            )
        )
    row = conn.execute(q.DOCTOR_PREPARED_AND_SLOTS).fetchone()
    if row is not None and (row[0] or row[1]):
        found.append(
            Finding(
                "oldest transaction",
                "warn",
                f"{row[0]} prepared transactions and {row[1]} replication slots hold back "
                "the xmin horizon",
                "COMMIT/ROLLBACK PREPARED forgotten ones; drop unused replication slots",
            )
        )
    return found or [Finding("oldest transaction", "ok", "nothing holds back VACUUM for long")]


def check_notifications(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    row = conn.execute(q.DOCTOR_NOTIFY_QUEUE).fetchone()
    usage = float(row[0]) if row else 0.0
    listeners = conn.execute(q.DOCTOR_LISTENERS).fetchone()
    count = listeners[0] if listeners else 0
    if usage > limits.notify_queue_usage:
        return [
            Finding(
                "notifications",
                "fail",
                f"the notification queue is {usage:.0%} full; when full, every NOTIFY "
                "(every enqueue) fails",
                "find the listener that stopped reading (a session stuck in a transaction "
                "after LISTEN) and end it",
            )
        ]
    if listeners and listeners[1]:
        return [
            Finding(
                "notifications",
                "warn",
                f"a listening session has been idle in a transaction for {listeners[1]:.0f}s; "
                "it cannot receive notifications and holds the queue back",
                "end that session",
            )
        ]
    noun = "listening session" if count == 1 else "listening sessions"
    return [Finding("notifications", "ok", f"queue {usage:.1%} used, {count} {noun}")]


def check_waiting(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    """Ready jobs nothing will claim: their queue is paused (a warning: it may be on
    purpose), or no live worker serves it (a failure: they wait forever)."""
    rows = conn.execute(
        render(q.DOCTOR_QUEUES_WAITING, schema), {"stale": limits.stale_worker_seconds}
    ).fetchall()
    found = []
    for queue, ready, paused, serving, live in rows:
        jobs = f"{ready} ready job{'' if ready == 1 else 's'}"
        if paused:
            found.append(
                Finding(
                    "waiting jobs",
                    "warn",
                    f"queue {queue} is paused with {jobs}",
                    f"skiplock queues resume {queue} (unless it is paused on purpose)",
                )
            )
        elif not serving and not live:
            found.append(
                Finding(
                    "waiting jobs",
                    "fail",
                    f"queue {queue} has {jobs} and no worker is alive",
                    "start one: skiplock worker MODULE:APP",
                )
            )
        elif not serving:
            found.append(
                Finding(
                    "waiting jobs",
                    "fail",
                    f"queue {queue} has {jobs} and none of the {live} live "
                    f"worker{'' if live == 1 else 's'} serves it",
                    f"start a worker with --queues {queue} (without --queues a worker "
                    "serves the queues of its app's tasks)",
                )
            )
    return found or [Finding("waiting jobs", "ok", "every queue with ready jobs is served")]


def check_workers(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    row = conn.execute(
        render(q.DOCTOR_STALE_WORKERS, schema), {"stale": limits.stale_worker_seconds}
    ).fetchone()
    registered, stale = (row[0], row[1]) if row else (0, 0)
    if not registered:
        return [
            Finding(
                "workers",
                "warn",
                "no worker is registered: nothing runs this schema's jobs",
                "start one: skiplock worker MODULE:APP",
            )
        ]
    if stale:
        return [
            Finding(
                "workers",
                "warn",
                f"{plural(stale, 'registered worker')} of {registered} not seen for "
                f"{limits.stale_worker_seconds:.0f}s (hung, or lease-only workers that died)",
                "their jobs are rescued when their leases expire; check those hosts",
            )
        ]
    return [
        Finding(
            "workers",
            "ok",
            f"{plural(registered, 'registered worker')}, each seen in the last "
            f"{limits.stale_worker_seconds:.0f}s",
        )
    ]


def check_dead(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    """Dead jobs: each queue's, a warning, since they wait for a human (retry or delete)."""
    rows = conn.execute(render(q.DOCTOR_DEAD_JOBS, schema)).fetchall()
    found = [
        Finding(
            "dead jobs",
            "warn",
            f"queue {queue} has {plural(dead, 'dead job')}"
            + ("" if latest is None else f", the latest tried {latest:.0f}s ago"),
            f"read them: skiplock jobs list --state dead --queue {queue}; then "
            f"skiplock jobs retry --all --state dead --queue {queue} (or delete)",
        )
        for queue, dead, latest in rows
    ]
    return found or [Finding("dead jobs", "ok", "none")]


def check_indexes(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    found = []
    invalid = [r[0] for r in conn.execute(q.DOCTOR_INVALID_INDEXES, {"schema": schema})]
    if invalid:
        found.append(
            Finding(
                "indexes",
                "fail",
                f"invalid indexes: {', '.join(invalid)}",
                "REINDEX INDEX CONCURRENTLY each (a failed concurrent build leaves them)",
            )
        )
    live_row = conn.execute(render(q.DOCTOR_JOBS_LIVE, schema)).fetchone()
    live = live_row[0] if live_row else 0
    for name, size in conn.execute(q.DOCTOR_INDEX_SIZES, {"schema": schema}):
        # A healthy partial index holds a few dozen bytes per live job at most.
        if size > 64 * 1024 * 1024 and size > 1024 * max(live, 1):
            found.append(
                Finding(
                    "indexes",
                    "warn",
                    f"{name} is {size / 1e6:.0f} MB for {live:,} live jobs: bloated",
                    f"REINDEX INDEX CONCURRENTLY {schema}.{name}",
                )
            )
    return found or [Finding("indexes", "ok", "valid, and not bloated")]


def check_history(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    rows = conn.execute(
        render(history_sql.HISTORY_PARTITIONS, schema),
        {"history": f'"{schema}".job_history'},
    ).fetchall()
    names = {r[0] for r in rows}
    tomorrow = datetime.now(UTC).date() + timedelta(days=1)
    found = []
    if history.partition_name(tomorrow) not in names:
        found.append(
            Finding(
                "history partitions",
                "fail",
                f"no partition for tomorrow ({history.partition_name(tomorrow)}): finished "
                "jobs will land in the DEFAULT partition",
                "run `skiplock prune` (a worker's leader does it every minute; is one running?)",
            )
        )
    default = sql.SQL(q.DOCTOR_HISTORY_DEFAULT_ROWS).format(
        history_default=sql.Identifier(schema, "job_history_default")
    )
    row = conn.execute(default).fetchone()
    if row and row[0]:
        found.append(
            Finding(
                "history partitions",
                "warn",
                f"{row[0]:,} finished jobs are in the DEFAULT partition (no partition existed "
                "for their day); they are pruned in batches, not dropped",
                "keep a worker running so that partitions are created ahead",
            )
        )
    return found or [Finding("history partitions", "ok", "created ahead; DEFAULT is empty")]


def check_transactional(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    rows = conn.execute(
        q.DOCTOR_LONG_TRANSACTIONAL,
        {"jobs": f'"{schema}".jobs', "limit": limits.transactional_job_seconds},
    ).fetchall()
    if rows:
        worst = rows[0]
        return [
            Finding(
                "transactional jobs",
                "warn",
                f"{len(rows)} sessions have held job rows locked for over "
                f"{limits.transactional_job_seconds:.0f}s (longest: pid {worst[0]}, "
                f"{worst[1]:.0f}s); each holds a transaction open and VACUUM back",
                "move long jobs to lease mode (transactional=False), or give them a timeout",
            )
        ]
    return [Finding("transactional jobs", "ok", "no long-running transactional jobs")]


def check_pooler(conn: Conn, schema: str, limits: Limits) -> list[Finding]:
    """Is this URL a pooler in transaction mode? Two more connections with the same
    settings tell (pooler.detect_transaction_pooling)."""
    password = conn.info.password

    def connect() -> Conn:
        return psycopg.connect(
            conn.info.dsn, password=password, prepare_threshold=None, connect_timeout=10
        )

    report = pooler.detect_transaction_pooling(connect)
    if report.transaction_pooling:
        return [
            Finding(
                "pooler",
                "warn",
                f"this URL goes through a pooler in transaction mode: {report.evidence}",
                "start workers with --pooler and --listen-url URL (PostgreSQL directly or a "
                "session-mode pool: LISTEN and the liveness lock), or --pooler alone (polling; "
                "rescue by lease expiry); run `skiplock migrate` on a direct URL",
            )
        ]
    return [Finding("pooler", "ok", f"no transaction-mode pooler: {report.evidence}")]


CHECKS: list[Callable[[Conn, str, Limits], list[Finding]]] = [
    check_migrations,
    check_autovacuum,
    check_horizon,
    check_notifications,
    check_workers,
    check_waiting,
    check_dead,
    check_indexes,
    check_history,
    check_transactional,
    check_pooler,
]


def run(conn: Conn, schema: str, limits: Limits | None = None) -> list[Finding]:
    """Every check, in order. Stops after migrations when the schema is not there."""
    limits = limits or Limits()
    findings = check_migrations(conn, schema, limits)
    if any(f.level == "fail" for f in findings):
        return findings
    for check in CHECKS[1:]:
        findings += check(conn, schema, limits)
    return findings
