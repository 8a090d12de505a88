"""The ``drain`` scenario, and the drain that other scenarios build on: ``--jobs`` no-op
jobs committed at once while ``--processes`` x ``--concurrency`` worker processes sit
idle, timed from that commit to the last ``finished_at`` in history (so the bench's own
polling does not blur it), with the CPU it cost per job."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from skiplock.bench.load import copy_jobs, fresh_schema, wait_drained
from skiplock.bench.measure import Cpu, CpuMeter, Figure, Report, Settings
from skiplock.bench.workers import Placement, worker_processes

# Writes the measured jobs: (connection, schema, count), inside the measured transaction.
Insert = Callable[[psycopg.Connection[Any], str, int], None]


def noop_jobs(conn: psycopg.Connection[Any], schema: str, count: int) -> None:
    copy_jobs(conn, schema, "bench.noop", count)


class Drained(NamedTuple):
    rate: float  # jobs per second
    cpu: Cpu  # per job: the worker processes' and the backends serving them


def _drain_seconds(conn: psycopg.Connection[Any], schema: str, started: Any) -> float:
    row = conn.execute(
        sql.SQL("SELECT extract(epoch FROM max(finished_at) - %s)::float8 FROM {}").format(
            sql.Identifier(schema, "job_history")
        ),
        (started,),
    ).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0])


def _checkpoint(conn: psycopg.Connection[Any]) -> None:
    """Write out what the setup (and earlier runs) left dirty, so that a checkpoint
    their WAL would start does not run during the drain measured after it. Skipped
    without the privilege (pg_checkpoint, or a superuser)."""
    try:
        conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        return


def drain(
    url: str,
    schema: str,
    jobs: int,
    processes: int,
    concurrency: int,
    *,
    setup: Callable[[psycopg.Connection[Any]], None] | None = None,
    insert: Insert = noop_jobs,
    placement: Placement | None = None,
) -> Drained:
    """One drain of ``jobs`` jobs written by ``insert`` in a fresh schema, after
    ``setup`` (rows already there, not measured) and a checkpoint; with ``placement``,
    the workers run on hosts of a topology."""
    with fresh_schema(url, schema), psycopg.connect(url, autocommit=True) as conn:
        if setup is not None:
            setup(conn)
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "jobs")))
        _checkpoint(conn)
        with worker_processes(url, schema, processes, concurrency, placement=placement) as children:
            meter = CpuMeter(conn, [c.pid for c in children], "skiplock %")
            with conn.transaction():
                insert(conn, schema, jobs)
            started = conn.execute("SELECT now()").fetchone()
            assert started is not None
            # now() above is after the commit: a slight underestimate of the drain time is
            # impossible, the commit is earlier still.
            wait_drained(conn, schema, timeout=600)
            cpu = meter.per_job(jobs)
            return Drained(jobs / _drain_seconds(conn, schema, started[0]), cpu)


def drain_runs(
    settings: Settings,
    *,
    setup: Callable[[psycopg.Connection[Any]], None] | None = None,
    insert: Insert = noop_jobs,
) -> list[float]:
    """Jobs per second of ``--runs`` drains at the settings' size (``drain``)."""
    s = settings
    return [
        drain(s.url, s.schema, s.jobs, s.processes, s.concurrency, setup=setup, insert=insert).rate
        for _ in range(s.runs)
    ]


def versus_drain(figure: Figure, report: Report) -> Figure:
    """``figure`` with its ratio to the plain drain (``vs_drain``), when that ran earlier
    in the same invocation."""
    plain = report.median("drain")
    if plain is not None:
        figure.extra["vs_drain"] = round(figure.median / plain, 2)
    return figure


def scenario(name: str, settings: Settings, report: Report) -> None:
    report.figure(Figure("drain", "jobs/s", drain_runs(settings)))
