"""The ``wakeup`` and ``latency`` scenarios: how soon an idle worker starts a job once its
transaction commits, p50, p95 and p99 over ``--samples`` jobs, for each insert path
(``wakeup``), or through ``Task.enqueue`` alone (``latency``)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.bench.enqueue_concurrent import PATH_ENQUEUE, PATH_SQL
from skiplock.bench.load import fresh_schema, probe_starts, wait_drained
from skiplock.bench.measure import Figure, Report, Settings, percentile
from skiplock.bench.tasks import probe
from skiplock.bench.workers import WORKER_SLOTS, worker_processes

WAKEUP_SAMPLES = 200
WAKEUP_GAP = 0.02
BATCH = 100


def _sqlalchemy() -> Any | None:
    """skiplock.contrib.sqlalchemy when SQLAlchemy is installed, else None. Loaded by
    name: the integration sits above the bench in the import layers, and is measured
    here exactly as an application calls it."""
    try:
        return importlib.import_module("skiplock.contrib.sqlalchemy")
    except ImportError:
        return None


def wakeup_paths() -> tuple[str, ...]:
    paths = (PATH_ENQUEUE, "enqueue_many, 1 job", f"enqueue_many, {BATCH} jobs", PATH_SQL)
    return (*paths, "SQLAlchemy enqueue") if _sqlalchemy() is not None else paths


class _Sampler:
    """Enqueues one sample through each insert path and notes its commit time."""

    def __init__(self, url: str, bench_app: App, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.bench_app = bench_app
        self.task = bench_app.task(name="bench.probe")(probe.fn)
        self.plain = sql.SQL(
            "INSERT INTO {} (task, args) VALUES ('bench.probe', '{{}}') RETURNING id"
        ).format(sql.Identifier(bench_app.schema, "jobs"))
        self.contrib: Any = _sqlalchemy()
        if self.contrib is not None:
            engine = importlib.import_module("sqlalchemy").create_engine(
                "postgresql+psycopg://", creator=lambda: psycopg.connect(url)
            )
            self.session_class = importlib.import_module("sqlalchemy.orm").Session
            self.engine = engine

    def close(self) -> None:
        if self.contrib is not None:
            self.engine.dispose()

    def sample(self, path: str) -> tuple[list[int], float]:
        conn = self.conn
        if path == PATH_ENQUEUE:
            ids = [int(self.task.enqueue(conn))]
        elif path == "enqueue_many, 1 job":
            ids = self.bench_app.enqueue_many(conn, [self.task.job()])
        elif path == f"enqueue_many, {BATCH} jobs":
            ids = self.bench_app.enqueue_many(conn, [self.task.job() for _ in range(BATCH)])
        elif path == PATH_SQL:
            row = conn.execute(self.plain).fetchone()
            assert row is not None
            ids = [int(row[0])]
        else:
            with self.session_class(self.engine) as session:
                ids = [int(self.contrib.enqueue(session, self.task))]
                session.commit()
                return ids, time.time()
        conn.commit()
        return ids, time.time()


def wakeup_once(
    url: str, schema: str, paths: Sequence[str], samples: int, gap: float
) -> dict[str, list[float]]:
    """Milliseconds from each sample's commit to its handler's start (the first start, for
    a batch), ``samples`` per path, the paths taken in turn so drift hits all alike; one
    worker process idle on the queue, ``gap`` seconds between samples."""
    with (
        fresh_schema(url, schema) as bench_app,
        worker_processes(url, schema, 1, WORKER_SLOTS),
        psycopg.connect(url) as conn,
        psycopg.connect(url, autocommit=True) as watch,
    ):
        sampler = _Sampler(url, bench_app, conn)
        taken: list[tuple[str, list[int], float]] = []
        try:
            for _ in range(samples):
                for path in paths:
                    ids, committed = sampler.sample(path)
                    taken.append((path, ids, committed))
                    if len(ids) > 1:  # the next sample must find the worker idle again
                        wait_drained(watch, schema, timeout=60)
                    time.sleep(gap)
        finally:
            sampler.close()
        started = probe_starts(watch, schema, timeout=60)
    waits: dict[str, list[float]] = {path: [] for path in paths}
    for path, ids, committed in taken:
        waits[path].append((min(started[i] for i in ids) - committed) * 1000)
    return waits


def wakeup(
    url: str,
    schema: str,
    runs: int,
    paths: Sequence[str] | None = None,
    samples: int = WAKEUP_SAMPLES,
    gap: float = WAKEUP_GAP,
    name: Callable[[str, str], str] = lambda path, pct: f"wake-up {path} {pct}",
) -> list[Figure]:
    """p50, p95 and p99 of the idle wake-up per insert path, each a median of ``runs``."""
    chosen = tuple(paths or wakeup_paths())
    figures = {
        (path, pct): Figure(name(path, pct), "ms", extra={"samples": samples})
        for path in chosen
        for pct in ("p50", "p95", "p99")
    }
    for _ in range(runs):
        for path, waits in wakeup_once(url, schema, chosen, samples, gap).items():
            for pct, share in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
                figures[path, pct].runs.append(percentile(waits, share))
    return list(figures.values())


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    if name == "wakeup":
        report.figure(*wakeup(s.url, s.schema, s.runs, samples=s.samples))
        return
    # ``latency``: the wake-up through Task.enqueue alone, under names of its own.
    figures = wakeup(
        s.url,
        s.schema,
        s.runs,
        paths=[PATH_ENQUEUE],
        samples=s.samples,
        name=lambda _path, pct: f"latency {pct}",
    )
    report.figure(*figures)
