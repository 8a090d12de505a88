"""The ``pressure`` scenario: a producer offers ``--rate`` jobs per second while workers
drain them, through phases (warm-up, clean, held, recovery) of ``--phases`` seconds; in
the held phase another session sits idle in a transaction with an xid, so VACUUM can
remove nothing. Per phase: throughput, deepest backlog, commit-to-start latency,
PostgreSQL CPU and index tuples read per job, dead tuples at the end."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from skiplock.bench.load import fresh_schema, offer, probe_starts
from skiplock.bench.measure import Report, Settings
from skiplock.bench.tasks import probe
from skiplock.bench.workers import worker_processes

PHASES = ("warm-up", "clean", "held", "recovery")


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    hold: bool = False


def _postgres_cpu_seconds() -> float | None:
    """CPU time used so far by every PostgreSQL server process on this machine; None
    without psutil (it comes with the embedded extra)."""
    try:
        import psutil  # noqa: PLC0415 - optional
    except ImportError:
        return None

    total = 0.0
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in ("postgres", "postmaster"):
            try:
                times = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += times.user + times.system
    return total


def _jobs_stats(conn: psycopg.Connection[Any], schema: str) -> tuple[int, int]:
    """Index tuples read on the jobs table so far, and its dead tuples now."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes"
        "        WHERE schemaname = %(s)s AND relname = 'jobs'),"
        "       (SELECT n_dead_tup FROM pg_stat_user_tables"
        "        WHERE schemaname = %(s)s AND relname = 'jobs')",
        {"s": schema},
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1] or 0)


def pressure_once(
    url: str,
    schema: str,
    *,
    rate: int,
    phases: Sequence[Phase],
    processes: int,
    concurrency: int,
) -> list[dict[str, Any]]:
    """Offer ``rate`` jobs/s in batches every 50 ms through the phases; one phase holds a
    transaction open (idle, with an xid) so VACUUM can remove nothing."""
    tick = 0.05
    with (
        fresh_schema(url, schema) as bench_app,
        worker_processes(url, schema, processes, concurrency),
        psycopg.connect(url, autocommit=True) as stats_conn,
        psycopg.connect(url) as producer,
        psycopg.connect(url) as holder,
    ):
        task = bench_app.task(name="bench.probe")(probe.fn)
        committed: dict[int, float] = {}
        stop = threading.Event()
        thread = threading.Thread(
            target=offer,
            args=(producer, bench_app, task.job, rate, tick, stop, committed),
            daemon=True,
        )
        thread.start()
        boundaries: list[dict[str, Any]] = []
        try:
            for phase in phases:
                if phase.hold:
                    holder.execute("SELECT txid_current()")  # now idle in transaction
                tuples, _ = _jobs_stats(stats_conn, schema)
                start = {"t": time.time(), "cpu": _postgres_cpu_seconds(), "tuples": tuples}
                time.sleep(phase.seconds)
                tuples, dead = _jobs_stats(stats_conn, schema)
                end = {"t": time.time(), "cpu": _postgres_cpu_seconds(), "tuples": tuples}
                if phase.hold:
                    holder.rollback()
                boundaries.append({"phase": phase, "start": start, "end": end, "dead": dead})
        finally:
            stop.set()
            thread.join()
        started = probe_starts(stats_conn, schema, timeout=600)
    return [_phase_figures(b, committed, started) for b in boundaries]


def _phase_figures(
    boundary: dict[str, Any], committed: dict[int, float], started: dict[int, float]
) -> dict[str, Any]:
    t0, t1 = boundary["start"]["t"], boundary["end"]["t"]
    offered = [i for i, at in committed.items() if t0 <= at < t1]
    waits = sorted((started[i] - committed[i]) * 1000 for i in offered if i in started)
    ran = sum(1 for at in started.values() if t0 <= at < t1)
    # Backlog at each commit instant in the phase: committed by then, not yet started.
    events = sorted(
        [(at, 1) for at in committed.values() if at < t1]
        + [(at, -1) for at in started.values() if at < t1]
    )
    depth = deepest = 0
    for at, step in events:
        depth += step
        if at >= t0:
            deepest = max(deepest, depth)
    jobs = max(ran, 1)
    return {
        "phase": boundary["phase"].name,
        "seconds": round(t1 - t0, 1),
        "throughput": round(ran / (t1 - t0), 1),
        "deepest_backlog": deepest,
        "latency_p50_ms": round(waits[len(waits) // 2], 2) if waits else None,
        "latency_p99_ms": round(waits[int(len(waits) * 0.99) - 1], 2) if waits else None,
        "pg_cpu_ms_per_job": (
            None
            if boundary["start"]["cpu"] is None
            else round((boundary["end"]["cpu"] - boundary["start"]["cpu"]) * 1000 / jobs, 3)
        ),
        "index_tuples_per_job": round(
            (boundary["end"]["tuples"] - boundary["start"]["tuples"]) / jobs, 1
        ),
        "dead_tuples_at_end": boundary["dead"],
    }


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    phases = [
        Phase(phase, seconds, hold=phase == "held")
        for phase, seconds in zip(PHASES, s.phase_seconds, strict=False)
    ]
    for _ in range(s.runs):
        report.pressure_run(
            pressure_once(
                s.url,
                s.schema,
                rate=s.rate,
                phases=phases,
                processes=s.processes,
                concurrency=s.concurrency,
            )
        )
