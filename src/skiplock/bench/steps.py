"""The ``steps`` scenario: what a durable step (skiplock.step) costs over a plain call.
Jobs of STEPS no-op steps each (async handlers, and sync ones whose records go through
the event loop) against as many plain no-op jobs, drain for drain; the figures are the
drain rates and, per step, the extra CPU of the worker processes and of the PostgreSQL
backends serving them."""

from __future__ import annotations

from typing import Any

import psycopg

from skiplock.bench.drain import Drained, drain, noop_jobs
from skiplock.bench.load import copy_jobs
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.tasks import STEPS


def _jobs_of(task: str) -> Any:
    def insert(conn: psycopg.Connection[Any], schema: str, count: int) -> None:
        copy_jobs(conn, schema, task, count)

    return insert


def _per_step(stepped: list[Drained], plain: list[Drained], which: str) -> float | None:
    """Median over runs of the extra CPU per step, in microseconds (None: not read)."""
    extra: list[float] = []
    for mine, theirs in zip(stepped, plain, strict=True):
        a, b = getattr(mine.cpu, which), getattr(theirs.cpu, which)
        if a is None or b is None:
            return None
        extra.append((a - b) / STEPS)
    extra.sort()
    return round(extra[len(extra) // 2], 1)


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    jobs = max(s.jobs // STEPS, 1)  # as many steps as the other scenarios have jobs
    shapes = {
        "plain": noop_jobs,
        "async": _jobs_of("bench.stepped"),
        "sync": _jobs_of("bench.stepped_sync"),
    }
    drained: dict[str, list[Drained]] = {shape: [] for shape in shapes}
    for _ in range(s.runs):  # run for run, so that the machine's drift hits all three
        for shape, insert in shapes.items():
            drained[shape].append(
                drain(s.url, s.schema, jobs, s.processes, s.concurrency, insert=insert)
            )
    plain = Figure(f"steps: {jobs:,} plain jobs", "jobs/s", [d.rate for d in drained["plain"]])
    report.figure(plain)
    for shape in ("async", "sync"):
        figure = Figure(
            f"steps: {jobs:,} jobs of {STEPS} steps, {shape} handlers",
            "jobs/s",
            [d.rate for d in drained[shape]],
        )
        figure.extra["vs_plain"] = round(figure.median / plain.median, 3)
        figure.extra["py_cpu_us_per_step"] = _per_step(
            drained[shape], drained["plain"], "python_us"
        )
        figure.extra["pg_cpu_us_per_step"] = _per_step(
            drained[shape], drained["plain"], "postgres_us"
        )
        report.figure(figure)
