"""Chaos, poison: one job in a hundred returns or raises what PostgreSQL cannot store.

``SKIPLOCK_CHAOS_JOBS`` jobs (see conftest.py; ``scripts/chaos --jobs 10000 -- -k poison``
runs the issue's full size) are drained by four workers, each a real ``skiplock.Worker``
on its own event loop and thread, in lease and transactional mode at once. One job in a
hundred is poison: it returns a string with a NUL or a lone surrogate, inf, a NUL deep in
a dict, raises with a NUL in its message, or asks to be retried at an impossible time.

The handlers record every run themselves (a thread-safe count by job id), so the checks
come from what ran:

- every good job ran exactly once and is completed, with its result;
- every poison job is dead after its two attempts, each attempt's error saying why;
- no outcome was dropped by any completer.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import WorkerThread, wait_until
from skiplock.retry import RetryPolicy

from .conftest import JOBS, SCHEMA, ChaosDatabase, record_figures, size_timeout

pytestmark = pytest.mark.chaos

WORKERS = 4
CONCURRENCY = 6
POISON_EVERY = 100
POISON_ATTEMPTS = 2
QUEUE = "poison"
TIMEOUT = size_timeout(180.0)
DRAIN_DEADLINE = 90.0 + JOBS / 40
QUICK = RetryPolicy(base=0.01, cap=0.05, jitter=0.5)


def _nul_message() -> None:
    raise ValueError("poison \x00 message")


def _surrogate_message() -> None:
    raise ValueError("poison \ud800 message")


def _retry_at_infinity() -> None:
    raise skiplock.Retry(after=math.inf)


# What each kind of poison does, and how its recorded error begins.
POISONS: dict[str, tuple[Callable[[], Any], str]] = {
    "nul": (lambda: "poison\x00", "result not storable: "),
    "surrogate": (lambda: "\ud800", "result not storable: "),
    "inf": (lambda: math.inf, "result not storable: "),
    "deep nul": (lambda: {"a": [1, {"b": "x\x00"}]}, "result not storable: "),
    "nul message": (_nul_message, "poison \\x00 message"),
    "surrogate message": (_surrogate_message, "poison \\ud800 message"),
    "retry at inf": (_retry_at_infinity, "Retry(after=inf)"),
}


class Runs:
    """Every handler run, by job id: the handlers' own record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[int] = Counter()

    def record(self) -> None:
        job_id = skiplock.current_job().id
        with self._lock:
            self.counts[job_id] += 1


def poison_app(url: str, runs: Runs) -> tuple[skiplock.App, dict[str, skiplock.Task[Any]]]:
    app = skiplock.App(url, schema=SCHEMA)

    @app.task(name="poison.good", queue=QUEUE)
    def good(n: int) -> dict[str, int]:
        runs.record()
        return {"n": n}

    @app.task(name="poison.good_async", queue=QUEUE)
    async def good_async(n: int) -> dict[str, int]:
        runs.record()
        return {"n": n}

    @app.task(name="poison.good_tx", queue=QUEUE, transactional=True)
    def good_tx(conn: psycopg.Connection[Any], n: int) -> dict[str, int]:
        runs.record()
        conn.execute("SELECT 1")
        return {"n": n}

    @app.task(name="poison.bad", queue=QUEUE, max_attempts=POISON_ATTEMPTS, retry=QUICK)
    def bad(kind: str) -> Any:
        runs.record()
        return POISONS[kind][0]()

    @app.task(
        name="poison.bad_tx",
        queue=QUEUE,
        transactional=True,
        max_attempts=POISON_ATTEMPTS,
        retry=QUICK,
    )
    def bad_tx(conn: psycopg.Connection[Any], kind: str) -> Any:
        runs.record()
        conn.execute("SELECT 1")
        return POISONS[kind][0]()

    tasks: dict[str, skiplock.Task[Any]] = {
        "good": good,
        "good_async": good_async,
        "good_tx": good_tx,
        "bad": bad,
        "bad_tx": bad_tx,
    }
    return app, tasks


def make_jobs(
    tasks: dict[str, skiplock.Task[Any]], rng: random.Random
) -> tuple[list[skiplock.JobSpec], dict[int, str]]:
    """The job mix, and which positions are poison (with their kind)."""
    specs: list[skiplock.JobSpec] = []
    poison: dict[int, str] = {}
    kinds = sorted(POISONS)
    for i in range(JOBS):
        if i % POISON_EVERY == POISON_EVERY - 1:
            kind = rng.choice(kinds)
            poison[i] = kind
            specs.append(tasks[rng.choice(["bad", "bad_tx"])].job(kind=kind))
        else:
            specs.append(tasks[rng.choice(["good", "good_async", "good_tx"])].job(n=i))
    return specs, poison


@pytest.mark.timeout(TIMEOUT)
def test_poison_fails_alone_and_every_good_job_runs_once(chaos_db: ChaosDatabase) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    runs = Runs()
    app, tasks = poison_app(chaos_db.url, runs)
    specs, poison = make_jobs(tasks, rng)
    with chaos_db.conn.transaction():
        ids = app.enqueue_many(chaos_db.conn, specs)

    started = time.monotonic()
    workers = [
        WorkerThread(
            skiplock.Worker(
                app,
                queues=[QUEUE],
                concurrency=CONCURRENCY,
                poll_interval=0.05,
                rescue_interval=0.5,
                shutdown_timeout=10.0,
            )
        ).start()
        for _ in range(WORKERS)
    ]
    try:

        def drained() -> bool:
            left = chaos_db.scalar(f"SELECT count(*) FROM {SCHEMA}.jobs WHERE state <> 'dead'")
            return int(left) == 0

        wait_until(drained, DRAIN_DEADLINE, interval=0.1, what="the queue to drain")
        seconds = time.monotonic() - started
    finally:
        for worker in workers:
            worker.request_stop()
        for worker in workers:
            worker.join(60)

    poison_ids = {ids[i]: kind for i, kind in poison.items()}
    good_ids = set(ids) - set(poison_ids)
    completed = dict(
        chaos_db.conn.execute(
            f"SELECT id, result FROM {SCHEMA}.job_history WHERE state = 'completed'"
        ).fetchall()
    )
    dead = {
        int(row[0]): (int(row[1]), row[2])
        for row in chaos_db.conn.execute(
            f"SELECT id, attempts, errors FROM {SCHEMA}.jobs WHERE state = 'dead'"
        ).fetchall()
    }

    assert set(completed) == good_ids
    assert all(completed[job_id] == {"n": ids.index(job_id)} for job_id in good_ids)
    reruns = {job_id: n for job_id in good_ids if (n := runs.counts[job_id]) != 1}
    assert reruns == {}, f"good jobs not run exactly once: {sorted(reruns.items())[:10]}"
    assert set(dead) == set(poison_ids)
    for job_id, kind in poison_ids.items():
        attempts, errors = dead[job_id]
        assert attempts == POISON_ATTEMPTS, (kind, attempts, errors)
        messages = [error["message"] for error in errors]
        assert len(messages) == POISON_ATTEMPTS, (kind, messages)
        assert all(m.startswith(POISONS[kind][1]) for m in messages), (kind, messages)
        assert runs.counts[job_id] == POISON_ATTEMPTS, (kind, runs.counts[job_id])
    stats = [w.worker.completer.stats for w in workers if w.worker.completer is not None]
    assert sum(s.dropped for s in stats) == 0
    assert sum(s.refused for s in stats) == 0

    record_figures(
        {
            "scenario": "poison",
            "mix": "poison",
            "jobs": JOBS,
            "completed": len(completed),
            "dead": len(dead),
            "lost": len(set(ids) - set(completed) - set(dead)),
            "seconds": round(seconds, 2),
            "throughput": round(JOBS / seconds, 1),
            "stale_accepted": 0,
            "reruns": {},
            "events": {"poison": len(poison_ids)},
            "unstorable_isolated": sum(s.unstorable for s in stats),
            "seed": seed,
        }
    )
