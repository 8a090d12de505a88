"""The ``enqueue`` scenario: jobs per second through ``App.enqueue_many``, building the jobs
included, into an empty schema."""

from __future__ import annotations

import time

import psycopg

from skiplock.bench.load import fresh_schema
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.tasks import noop


def enqueue_once(url: str, schema: str, jobs: int) -> float:
    with fresh_schema(url, schema) as bench_app, psycopg.connect(url) as conn:
        task = bench_app.tasks.get("bench.noop") or bench_app.task(name="bench.noop")(noop.fn)
        started = time.perf_counter()
        bench_app.enqueue_many(conn, [task.job() for _ in range(jobs)])
        conn.commit()
        return jobs / (time.perf_counter() - started)


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    runs = [enqueue_once(s.url, s.schema, s.jobs) for _ in range(s.runs)]
    report.figure(Figure("enqueue (enqueue_many)", "jobs/s", runs))
