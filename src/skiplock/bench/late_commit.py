"""The ``late-commit`` scenario: a busy worker draining a steady stream of short jobs, and
a job whose transaction began before stream jobs the worker has since claimed. Its
commit-to-start latency, at the stream's priority and ahead of it, and the share of
such jobs the worker's claims had already passed when they committed."""

from __future__ import annotations

import statistics
import threading
import time
from bisect import bisect_right
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.bench.load import fresh_schema, offer, wait_drained
from skiplock.bench.measure import Figure, Report, Settings, percentile
from skiplock.bench.tasks import pause, probe
from skiplock.bench.workers import WORKER_SLOTS, worker_processes

LATE_HOLD = 0.1  # the late transaction stays open this long after its insert
LATE_GAP = 0.05
LATE_MIN_SAMPLES = 5
# The stream keeps the worker's slots this busy on average, whatever its rate.
STREAM_LOAD = 0.8
STREAM_TICK = 0.01


def stream_job_ms(rate: int) -> int:
    return max(1, round(STREAM_LOAD * WORKER_SLOTS * 1000 / rate))


def _feed(url: str, bench_app: App, rate: int, stop: threading.Event) -> None:
    """``rate`` pause jobs per second, a transaction every STREAM_TICK."""
    task = bench_app.task(name="bench.pause")(pause.fn)
    ms = stream_job_ms(rate)
    with psycopg.connect(url) as conn:
        offer(conn, bench_app, lambda: task.job(ms=ms), rate, STREAM_TICK, stop)


def _late_jobs(conn: psycopg.Connection[Any], late: Any, seconds: float) -> dict[int, float]:
    """Open a transaction, insert one job (its place in line: the transaction's start),
    hold it LATE_HOLD while the stream's later jobs commit and are claimed, commit;
    repeat for ``seconds``. Each job's commit time."""
    committed: dict[int, float] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(committed) < LATE_MIN_SAMPLES:
        job_id = int(late.enqueue(conn))
        time.sleep(LATE_HOLD)
        conn.commit()
        committed[job_id] = time.time()
        time.sleep(LATE_GAP)
    return committed


def late_commit_once(url: str, schema: str, rate: int, seconds: float) -> dict[str, Any]:
    """Both variants of a late job (the stream's priority, then ahead of it) against one
    busy worker: commit-to-start milliseconds of each, and the share of late jobs that
    the worker had already passed, a stream job behind them in line claimed before their
    commit (on this machine's clock: a server here)."""
    with (
        fresh_schema(url, schema) as bench_app,
        worker_processes(url, schema, 1, WORKER_SLOTS),
        psycopg.connect(url) as conn,
        psycopg.connect(url, autocommit=True) as watch,
    ):
        probe_task = bench_app.task(name="bench.probe")(probe.fn)
        variants = {"same": probe_task, "higher": probe_task.with_options(priority=-1)}
        stop = threading.Event()
        feeder = threading.Thread(target=_feed, args=(url, bench_app, rate, stop), daemon=True)
        feeder.start()
        committed: dict[str, dict[int, float]] = {}
        try:
            time.sleep(0.5)  # the stream under way
            for variant, late in variants.items():
                committed[variant] = _late_jobs(conn, late, seconds)
        finally:
            stop.set()
            feeder.join()
        wait_drained(watch, schema, timeout=600)
        rows = watch.execute(
            sql.SQL(
                "SELECT id, task, priority, extract(epoch FROM created_at)::float8, "
                "extract(epoch FROM attempted_at)::float8, result FROM {}"
            ).format(sql.Identifier(schema, "job_history"))
        ).fetchall()
    stream = sorted((r[2], r[3], r[0], r[4]) for r in rows if r[1] == "bench.pause")
    positions = [(p, at, i) for p, at, i, _ in stream]
    # The earliest claim among the stream jobs from each position on.
    earliest = [float("inf")] * (len(stream) + 1)
    for index in range(len(stream) - 1, -1, -1):
        earliest[index] = min(stream[index][3], earliest[index + 1])
    late_rows = {r[0]: r for r in rows if r[1] == "bench.probe"}
    found: dict[str, Any] = {}
    for variant, commits in committed.items():
        waits, passed = [], 0
        for job_id, at in commits.items():
            row = late_rows[job_id]
            waits.append((float(row[5]) - at) * 1000)
            behind = bisect_right(positions, (row[2], row[3], job_id))
            passed += earliest[behind] < at
        found[variant] = {"waits": waits, "passed": passed / len(commits)}
    return found


def late_commit(url: str, schema: str, rate: int, seconds: float, runs: int) -> list[Figure]:
    """p50 and p99 of the late jobs' commit-to-start latency, at the stream's priority and
    at a higher one, each a median of ``runs``."""
    labels = {"same": "late-commit", "higher": "late-commit, higher priority"}
    figures = {
        (variant, pct): Figure(f"{label} {pct}", "ms")
        for variant, label in labels.items()
        for pct in ("p50", "p99")
    }
    samples: dict[str, list[int]] = {variant: [] for variant in labels}
    passed: dict[str, list[float]] = {variant: [] for variant in labels}
    for _ in range(runs):
        for variant, found in late_commit_once(url, schema, rate, seconds).items():
            figures[variant, "p50"].runs.append(percentile(found["waits"], 0.5))
            figures[variant, "p99"].runs.append(percentile(found["waits"], 0.99))
            samples[variant].append(len(found["waits"]))
            passed[variant].append(found["passed"])
    stream = f"{rate} jobs/s of {stream_job_ms(rate)} ms, 1 worker x {WORKER_SLOTS}"
    for (variant, _), figure in figures.items():
        figure.extra.update(
            samples=sum(samples[variant]),
            passed=round(statistics.median(passed[variant]), 2),
            hold_ms=round(LATE_HOLD * 1000),
            stream=stream,
        )
    return list(figures.values())


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    report.figure(*late_commit(s.url, s.schema, s.rate, s.enqueue_seconds, s.runs))
