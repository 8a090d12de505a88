"""The ``history`` and ``scheduled`` scenarios: the drain with ``--history-rows`` rows
already in the way, finished ones in history or far-future ones in the jobs table, and
its ratio to the plain drain when that ran first (``vs_drain``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.drain import drain_runs, versus_drain
from skiplock.bench.load import copy_jobs
from skiplock.bench.measure import Figure, Report, Settings

KINDS = {"history": "finished", "scheduled": "scheduled"}


def history_setup(schema: str, kind: str, rows: int) -> Callable[[psycopg.Connection[Any]], None]:
    def setup(conn: psycopg.Connection[Any]) -> None:
        if kind == "finished":
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (id, queue, task, args, state, priority, attempts, "
                    "max_attempts, errors, created_at, attempted_at, finished_at) "
                    "SELECT -g, 'default', 'bench.noop', '{{}}', 'completed', 0, 1, 3, '[]', "
                    "now() - interval '1 day', now() - interval '1 day', "
                    "now() - interval '1 day' FROM generate_series(1, %s) AS g"
                ).format(sql.Identifier(schema, "job_history")),
                (rows,),
            )
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "job_history")))
        else:
            copy_jobs(
                conn,
                schema,
                "bench.noop",
                rows,
                state="scheduled",
                run_at="now() + interval '1 day'",
            )

    return setup


def scenario(name: str, settings: Settings, report: Report) -> None:
    kind, rows = KINDS[name], settings.history_rows
    runs = drain_runs(settings, setup=history_setup(settings.schema, kind, rows))
    report.figure(versus_drain(Figure(f"drain, {rows:,} {kind} rows", "jobs/s", runs), report))
