"""The ``steps-chaos`` scenario: durable steps through crashes. ``--jobs`` jobs (at most
1,000) of three steps, each step's effect a row its handler inserts; worker processes
(at most 10 slots each, so that the run lasts several seconds) are SIGKILLed, one a
second, and replaced. The figures: effects that happened more than once (each one should be
a step in flight at a kill: run, but not yet recorded), how many of those first ran in a
process that was not killed (none should), kills, and jobs or steps lost (none)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.load import copy_jobs, fresh_schema
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.tasks import EFFECT_STEPS, app
from skiplock.bench.workers import WORKER_ARGS, stop_processes
from skiplock.demo import worker_command, worker_env

MOST_JOBS = 1_000
MOST_SLOTS = 10
KILL_EVERY = 1.0
EFFECTFUL = "bench.effectful"


def _spawn(url: str, schema: str, slots: int) -> subprocess.Popen[bytes]:
    command = worker_command(
        schema,
        "skiplock.bench:app",
        *("--concurrency", str(slots), "--poll-interval", "0.5", "--shutdown-timeout", "1"),
        *WORKER_ARGS,
    )
    return subprocess.Popen(
        command, env=worker_env(url, schema), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )


def enqueue(conn: psycopg.Connection[Any], schema: str, count: int) -> None:
    """The scenario's jobs, with the task's attempts: a job can lose one attempt to each
    kill, and the figure is the effects repeated, not the jobs that ran out of them."""
    copy_jobs(
        conn, schema, EFFECTFUL, count, max_attempts=app.tasks[EFFECTFUL].options.max_attempts
    )


def left(conn: psycopg.Connection[Any], schema: str) -> int:
    """Jobs still to run: a dead one never will (it counts as lost)."""
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE state <> 'dead'").format(
            sql.Identifier(schema, "jobs")
        )
    ).fetchone()
    return int(row[0]) if row else 0


def _one_run(settings: Settings, count: int) -> dict[str, float]:
    s = settings
    slots = min(s.concurrency, MOST_SLOTS)
    with fresh_schema(s.url, s.schema), psycopg.connect(s.url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (job bigint NOT NULL, step text NOT NULL, pid int NOT NULL, "
                "at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(s.schema, "bench_effects"))
        )
        enqueue(conn, s.schema, count)
        children = [_spawn(s.url, s.schema, slots) for _ in range(s.processes)]
        killed: set[int] = set()
        kills, started = 0, time.monotonic()
        last_kill = started
        try:
            while left(conn, s.schema):
                if time.monotonic() - started > 600:
                    raise RuntimeError("the steps-chaos jobs did not finish within 600 s")
                if time.monotonic() - last_kill >= KILL_EVERY:
                    victim = random.randrange(len(children))
                    children[victim].send_signal(signal.SIGKILL)
                    killed.add(children[victim].pid)
                    children[victim].wait()
                    children[victim] = _spawn(s.url, s.schema, slots)
                    kills, last_kill = kills + 1, time.monotonic()
                time.sleep(0.05)
            seconds = time.monotonic() - started
        finally:
            stop_processes(children)
        effects = sql.Identifier(s.schema, "bench_effects")
        counts = conn.execute(
            sql.SQL(
                "SELECT coalesce(sum(n - 1), 0), count(*) FROM "
                "(SELECT job, step, count(*) AS n FROM {} GROUP BY job, step) AS e"
            ).format(effects)
        ).fetchone()
        # A repeat explained by a kill: the step's first effect came from a killed process
        # (it ran there, and its record was not written before the kill).
        unexplained = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM (SELECT DISTINCT ON (job, step) job, step, pid FROM {} "
                "WHERE (job, step) IN (SELECT job, step FROM {} GROUP BY job, step "
                "HAVING count(*) > 1) ORDER BY job, step, at) AS first "
                "WHERE pid <> ALL(%s)"
            ).format(effects, effects),
            (sorted(killed),),
        ).fetchone()
        completed = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE state = 'completed'").format(
                sql.Identifier(s.schema, "job_history")
            )
        ).fetchone()
    assert counts is not None and completed is not None and unexplained is not None
    return {
        "repeated": float(counts[0]),
        "unexplained": float(unexplained[0]),
        "steps_lost": float(count * len(EFFECT_STEPS) - int(counts[1])),
        "jobs_lost": float(count - int(completed[0])),
        "kills": float(kills),
        "seconds": seconds,
    }


def scenario(name: str, settings: Settings, report: Report) -> None:
    count = min(settings.jobs, MOST_JOBS)
    runs = [_one_run(settings, count) for _ in range(settings.runs)]
    figure = Figure(
        f"steps-chaos: {count:,} jobs of {len(EFFECT_STEPS)} steps, a SIGKILL a second",
        "repeated effects",
        [r["repeated"] for r in runs],
    )
    figure.extra["kills"] = [int(r["kills"]) for r in runs]
    figure.extra["per_kill"] = [round(r["repeated"] / max(r["kills"], 1), 1) for r in runs]
    figure.extra["not_by_a_kill"] = sum(int(r["unexplained"]) for r in runs)
    figure.extra["steps_lost"] = sum(int(r["steps_lost"]) for r in runs)
    figure.extra["jobs_lost"] = sum(int(r["jobs_lost"]) for r in runs)
    figure.extra["seconds"] = [round(r["seconds"], 1) for r in runs]
    report.figure(figure)
