"""The ``workflow`` scenario (issue 23): what workflows cost next to plain jobs.

- enqueue: one workflow of ``--jobs`` steps (layers of 100, each step after two of the
  layer before) built, checked and enqueued in one call, timed to its commit;
- hop: a chain of up to 1,000 steps, one worker process: from a parent's completion
  (its ``finished_at``) to its child's claim (``attempted_at``), both the database's;
- fan-out/fan-in: workflows of up to 100 steps (one root, the rest after it, one last
  step after them all), ``--jobs`` steps in all, drained against a plain drain of as
  many jobs, run for run;
- fan-in: ``--jobs`` - 1 parents into one child, drained against the same plain drain:
  the cost of a parent's completion must not grow with its siblings.

Each drain's schema has the history partitions of the past week, as a worker at the
default retention leaves it: a step's end must not pay for the days kept.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.bench.drain import Insert, drain, noop_jobs
from skiplock.bench.load import fresh_schema, wait_drained
from skiplock.bench.measure import Figure, Report, Settings, percentile
from skiplock.bench.workers import worker_processes
from skiplock.workflow import Workflow

NOOP = "bench.noop"
LAYER = 100
CHAIN = 1000
FAN = 100
# The days of history a worker keeps by default (--history-retention-days).
RETAINED_DAYS = 7


def _noop() -> None:
    return None


def _app(url: str, schema: str) -> App:
    """An App of the scenario's schema whose one task is the bench's no-op (the worker
    processes run the bench's own App, whose task has that name)."""
    app = App(url, schema=schema)
    app.task(name=NOOP)(_noop)
    return app


def layered(app: App, steps: int) -> Workflow:
    """``steps`` steps in layers of LAYER, each after two steps of the layer before."""
    workflow = app.workflow("layers")
    noop = app.tasks[NOOP]
    previous: list[Any] = []
    layer: list[Any] = []
    for n in range(steps):
        if len(layer) == LAYER:
            previous, layer = layer, []
        after = [previous[n % len(previous)], previous[(n + 1) % len(previous)]] if previous else []
        layer.append(workflow.add(noop.job(), name=f"s{n}", after=after))
    return workflow


def fan(app: App, steps: int) -> Workflow:
    """One root, ``steps`` - 2 steps after it, and one step after them all."""
    workflow = app.workflow("fan")
    noop = app.tasks[NOOP]
    root = workflow.add(noop.job(), name="root")
    middle = [workflow.add(noop.job(), name=f"m{n}", after=[root]) for n in range(steps - 2)]
    workflow.add(noop.job(), name="last", after=middle or [root])
    return workflow


def fan_in(app: App, parents: int) -> Workflow:
    workflow = app.workflow("fan-in")
    noop = app.tasks[NOOP]
    steps = [workflow.add(noop.job(), name=f"p{n}") for n in range(parents)]
    workflow.add(noop.job(), name="child", after=steps)
    return workflow


def enqueue_rate(url: str, schema: str, steps: int) -> float:
    """Steps per second of one workflow's building, checking, enqueue and commit."""
    with fresh_schema(url, schema), psycopg.connect(url) as conn:
        app = _app(url, schema)
        started = time.perf_counter()
        layered(app, steps).enqueue(conn)
        conn.commit()
        return steps / (time.perf_counter() - started)


def hops_ms(url: str, schema: str, steps: int, concurrency: int) -> list[float]:
    """Each hop of a chain of ``steps``, in milliseconds."""
    with fresh_schema(url, schema), psycopg.connect(url, autocommit=True) as conn:
        app = _app(url, schema)
        with worker_processes(url, schema, 1, concurrency):
            chain = app.workflow("chain")
            previous: list[Any] = []
            for n in range(steps):
                previous = [chain.add(app.tasks[NOOP].job(), name=f"c{n}", after=previous)]
            with conn.transaction():
                ref = chain.enqueue(conn)
            wait_drained(conn, schema, timeout=600)
        ids = [int(ref.steps[f"c{n}"]) for n in range(steps)]
        rows = conn.execute(
            sql.SQL("SELECT id, attempted_at, finished_at FROM {} WHERE id = ANY(%s)").format(
                sql.Identifier(schema, "job_history")
            ),
            (ids,),
        ).fetchall()
    times = {row[0]: (row[1], row[2]) for row in rows}
    return [
        (times[child][0] - times[parent][1]).total_seconds() * 1000
        for parent, child in itertools.pairwise(ids)
    ]


def workflow_jobs(build: Callable[[App, int], list[Workflow]]) -> Insert:
    """Writes the workflows ``build`` makes of ``count`` steps, in the measured
    transaction."""

    def insert(conn: psycopg.Connection[Any], schema: str, count: int) -> None:
        url = conn.info.dsn
        app = _app(url, schema)
        for workflow in build(app, count):
            workflow.enqueue(conn)

    return insert


def with_past_history(insert: Insert, days: int = RETAINED_DAYS) -> Insert:
    """``insert``, after creating the history partitions of the past ``days`` days."""

    def setup_and_insert(conn: psycopg.Connection[Any], schema: str, count: int) -> None:
        conn.execute(
            sql.SQL(
                "SELECT {}((now() AT TIME ZONE 'UTC')::date - k) FROM generate_series(1, %s) AS k"
            ).format(sql.Identifier(schema, "history_partition_create")),
            (days,),
        )
        insert(conn, schema, count)

    return setup_and_insert


def _fans(app: App, steps: int) -> list[Workflow]:
    """Workflows of FAN steps, the last one smaller: ``steps`` in all (at least 3)."""
    sizes = [FAN] * (steps // FAN)
    rest = steps % FAN
    if rest >= 3 or not sizes:
        sizes.append(max(rest, 3))
    elif rest:
        sizes[-1] += rest
    return [fan(app, size) for size in sizes]


def _fan_in(app: App, steps: int) -> list[Workflow]:
    return [fan_in(app, max(1, steps - 1))]


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    report.figure(
        Figure(
            f"workflow enqueue, {s.jobs:,} steps in one call",
            "steps/s",
            [enqueue_rate(s.url, s.schema, s.jobs) for _ in range(s.runs)],
        )
    )
    chain = min(CHAIN, s.jobs)
    per_run = [hops_ms(s.url, s.schema, chain, s.concurrency) for _ in range(s.runs)]
    hop = Figure(
        f"workflow hop, a chain of {chain:,}", "ms", [statistics.median(h) for h in per_run]
    )
    hop.extra["p90_ms"] = round(statistics.median(percentile(h, 0.9) for h in per_run), 3)
    report.figure(hop)
    drained: dict[str, list[float]] = {"plain": [], "fan": [], "fan-in": []}
    inserts: dict[str, Insert] = {
        "plain": with_past_history(noop_jobs),
        "fan": with_past_history(workflow_jobs(_fans)),
        "fan-in": with_past_history(workflow_jobs(_fan_in)),
    }
    for _ in range(s.runs):  # run for run, so that the machine's drift hits all three
        for shape, insert in inserts.items():
            rate = drain(s.url, s.schema, s.jobs, s.processes, s.concurrency, insert=insert).rate
            drained[shape].append(rate)
    plain = Figure(f"drain, {s.jobs:,} plain jobs", "jobs/s", drained["plain"])
    report.figure(plain)
    for shape, label in (("fan", "fan-out/fan-in workflows"), ("fan-in", "one fan-in")):
        figure = Figure(f"drain, {s.jobs:,} steps as {label}", "steps/s", drained[shape])
        figure.extra["vs_plain"] = round(figure.median / plain.median, 3)
        report.figure(figure)
