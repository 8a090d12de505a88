"""The ``signals`` scenario: durable waits and the signals that end them.

- Latency: ``--jobs`` jobs (at most 10,000) wait each for a key of its own; then eight
  connections send their signals by plain SQL (``SELECT schema.signal(...)``, each its
  own commit) in random order. Each handler returns when it resumed: the figure is the
  median of signal commit to resume, with p95, and the rate the signals went out at.
- Cost: a drain of plain jobs beside ten times as many waiting and sleeping jobs (at
  most 100,000, half of each), against the same drain with none, run for run."""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.drain import drain
from skiplock.bench.load import copy_jobs, fresh_schema, wait_drained
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.workers import worker_processes

SENDERS = 8
MOST_WAITERS = 10_000
MOST_IDLE = 100_000


def _wait_until_waiting(conn: psycopg.Connection[Any], schema: str, count: int) -> None:
    query = sql.SQL("SELECT count(*) FROM {} WHERE wait_key IS NOT NULL").format(
        sql.Identifier(schema, "jobs")
    )
    deadline = time.monotonic() + 600
    while True:
        row = conn.execute(query).fetchone()
        if row is not None and int(row[0]) >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} jobs did not all come to wait within 600 s")
        time.sleep(0.05)


def _send(url: str, schema: str, ids: list[int], committed: dict[int, float]) -> None:
    statement = sql.SQL("SELECT {}.signal(%s, %s::jsonb)").format(sql.Identifier(schema))
    with psycopg.connect(url, autocommit=True) as conn:
        for job_id in ids:
            conn.execute(statement, (f"b:{job_id}", f'{{"n": {job_id}}}'))
            committed[job_id] = time.time()  # autocommit: the statement's commit returned


def _one_latency_run(settings: Settings, count: int) -> tuple[list[float], float]:
    """Each signal's commit-to-resume time in ms, and signals per second sent."""
    s = settings
    with (
        fresh_schema(s.url, s.schema),
        psycopg.connect(s.url, autocommit=True) as conn,
        worker_processes(s.url, s.schema, s.processes, s.concurrency),
    ):
        copy_jobs(conn, s.schema, "bench.waiter", count)
        _wait_until_waiting(conn, s.schema, count)
        rows = conn.execute(
            sql.SQL("SELECT id FROM {}").format(sql.Identifier(s.schema, "jobs"))
        ).fetchall()
        ids = [int(r[0]) for r in rows]
        random.shuffle(ids)
        committed: dict[int, float] = {}
        shares = [ids[i::SENDERS] for i in range(SENDERS)]
        threads = [
            threading.Thread(target=_send, args=(s.url, s.schema, share, committed))
            for share in shares
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sent = count / (time.monotonic() - started)
        wait_drained(conn, s.schema, timeout=600)
        rows = conn.execute(
            sql.SQL("SELECT id, result::float8 FROM {} WHERE state = 'completed'").format(
                sql.Identifier(s.schema, "job_history")
            )
        ).fetchall()
        resumed: dict[int, float] = {int(r[0]): float(r[1]) for r in rows}
    if len(resumed) != count:
        raise RuntimeError(f"{count - len(resumed)} of {count} waiting jobs did not resume")
    return [(resumed[i] - committed[i]) * 1000 for i in ids], sent


def _idle_rows(schema: str, count: int) -> Any:
    """Setup: ``count`` jobs that wait for signals nobody sends, or sleep for days."""

    def setup(conn: psycopg.Connection[Any]) -> None:
        jobs = sql.Identifier(schema, "jobs")
        half = count // 2
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (task, state, wait_key, wait_step, wait_until) "
                "SELECT 'bench.waiter', 'waiting', 'idle:' || g, 'wait:idle:' || g, "
                "now() + interval '3 days' FROM generate_series(1, %s) AS g"
            ).format(jobs),
            (half,),
        )
        copy_jobs(
            conn,
            schema,
            "bench.noop",
            count - half,
            state="scheduled",
            run_at="now() + interval '3 days'",
        )

    return setup


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    count = min(s.jobs, MOST_WAITERS)
    medians, p95s, rates = [], [], []
    for _ in range(s.runs):
        latencies, sent = _one_latency_run(s, count)
        medians.append(statistics.median(latencies))
        p95s.append(statistics.quantiles(latencies, n=20)[-1] if len(latencies) > 1 else 0.0)
        rates.append(sent)
    latency = Figure(f"signals: {count:,} waits, signal commit to resume p50", "ms", medians)
    latency.extra["p95_ms"] = round(statistics.median(p95s), 2)
    latency.extra["signals_per_s"] = round(statistics.median(rates))
    report.figure(latency)

    idle = min(s.jobs * 10, MOST_IDLE)
    beside, alone = [], []
    for _ in range(s.runs):  # run for run, so that the machine's drift hits both
        setup = _idle_rows(s.schema, idle)
        beside.append(drain(s.url, s.schema, s.jobs, s.processes, s.concurrency, setup=setup).rate)
        alone.append(drain(s.url, s.schema, s.jobs, s.processes, s.concurrency).rate)
    plain = Figure(f"signals: drain of {s.jobs:,} plain jobs", "jobs/s", alone)
    report.figure(plain)
    crowded = Figure(f"signals: the same beside {idle:,} waiting and sleeping", "jobs/s", beside)
    crowded.extra["vs_plain"] = round(crowded.median / plain.median, 3)
    report.figure(crowded)
