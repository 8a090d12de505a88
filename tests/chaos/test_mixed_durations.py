"""Chaos with mixed durations (issue 20): short jobs and a few long ones, half of them on a
queue with a concurrency limit, two workers of two slots, one SIGKILLed every 3 s.

Besides what every chaos scenario checks (none lost, none completed twice: one history
row per job, every re-run explained), it measures how long each job waited at a worker
that could not start it while the other worker had a free slot (issue 20, item 1: at
most about 50 ms, or two claim round trips). Everything is read from the records:

- claim: the ``attempted_at`` of the job's accepted attempt (the database's clock, set by
  the claim that handed it to its worker);
- start: the handler's own record of its start (chaos_app.py), the same host's clock;
- each worker's busy slots: the handlers' start and end records of its executions (an
  execution cut short by the kill ends at the kill); a worker counts from its first
  start to its kill, not while it is still starting up;
- a job of the limited queue counts as startable elsewhere only while fewer than the
  limit of that queue's jobs were running (started), as item 2 requires.

The held-back time of a job is the part of [claim, start] during which the other
worker was up, had a free slot and could have started the job (stretches of under 5 ms,
that worker going from one job to its next, are not counted). The bound asserted is
item 1's 50 ms (two claim round trips are a few milliseconds here) plus 250 ms for this
machine's noise: 2 cores, shared in the test command with the other xdist workers and
the embedded server's half, and handler threads and the recorder's own round trip sit
between a slot freeing and the record of the next start (0.107 s seen there; 50 and 41
ms on a quiet machine). Jobs held back by claim-ahead, the fault this guards against,
waited seconds. The worst held-back time is reported with the figures.

On 2 cores shared with other work the scenario takes about a minute with items 1 and 2
of issue 20 fixed (67 and 69 s; worst held back 50 and 41 ms); without them 2.3 to 3.5
minutes, as the limited queue drains at 10 to 25 jobs a second while its claimed-ahead
jobs count against its limit.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest

import skiplock
from skiplock import client

from .chaos_app import work_async, work_sync
from .conftest import JOBS as CHAOS_JOBS
from .conftest import SCHEMA, ChaosDatabase, Fleet, record_figures
from .test_chaos import (
    Execution,
    Verdict,
    drain,
    enqueue,
    judge,
    registered_choice,
    scenario_figures,
)

pytestmark = pytest.mark.chaos

WORKERS = 2
SLOTS = 2
# 2,000 in the test command (half on the limited queue, which claim-ahead once held to
# 10 to 25 jobs a second: minutes, where it now drains in seconds); more when
# scripts/chaos asks for a larger run (SKIPLOCK_CHAOS_JOBS).
JOBS = max(2000, CHAOS_JOBS)
# About 1% of 2 s jobs: at 2,000, 20 of them are 40 s of work, 10 s on four slots, plus
# what the kills cut short; the short ones are 0.1 ms.
LONG_SHARE = 0.01
LONG_MS = 2000.0
SHORT_MS = 0.1
QUEUES = ("chaos", "chaos_limited")
LIMITED = "chaos_limited"
LIMIT = 2
KILL_EVERY = 3.0
# Issue 20, item 1; and what the measurement allows for this machine's noise.
WAIT_BOUND = 0.05
NOISE = 0.25
# A slot of the other worker free for less than this is that worker going from one of its
# jobs to the next (outcome, start record), not a slot it could have used: not counted.
TURNAROUND = 0.005
DEADLINE = 240.0
TIMEOUT = 360.0


def mixed_jobs(rng: random.Random) -> list[skiplock.JobSpec]:
    """Half async, half sync; independently, half on the limited queue; 1% long."""
    long = set(rng.sample(range(JOBS), int(JOBS * LONG_SHARE)))
    specs = []
    for i in range(JOBS):
        task = work_sync if i % 2 else work_async
        call = task.with_options(queue=LIMITED) if (i // 2) % 2 else task
        specs.append(call.job(ms=LONG_MS if i in long else SHORT_MS))
    return specs


class Level:
    """A count over time (busy slots, running jobs) from intervals: the count at any
    moment, and the moments it changes."""

    def __init__(self, intervals: Iterable[tuple[float, float]]) -> None:
        changes: dict[float, int] = {}
        for start, end in intervals:
            if end > start:
                changes[start] = changes.get(start, 0) + 1
                changes[end] = changes.get(end, 0) - 1
        self.times = sorted(changes)
        self.levels: list[int] = []
        level = 0
        for t in self.times:
            level += changes[t]
            self.levels.append(level)

    def at(self, t: float) -> int:
        index = bisect.bisect_right(self.times, t)
        return self.levels[index - 1] if index else 0

    def changes(self, start: float, end: float) -> list[float]:
        return self.times[
            bisect.bisect_right(self.times, start) : bisect.bisect_left(self.times, end)
        ]


@dataclass(frozen=True)
class Wait:
    job_id: int
    pid: int
    queue: str
    ms: float
    waited: float
    held_back: float


def held_back_waits(db: ChaosDatabase, fleet: Fleet, verdict: Verdict) -> list[Wait]:
    """For each job's accepted attempt: how long it waited from its claim to its start,
    and how much of that the other worker was up with a free slot it could use."""
    rows = db.conn.execute(
        f"SELECT id, queue, attempts, attempted_at, result, args FROM {SCHEMA}.job_history"
    ).fetchall()
    queue_of = {int(r[0]): str(r[1]) for r in rows}
    epoch = min(e.started for runs in verdict.executions.values() for e in runs)

    def s(at: datetime) -> float:
        return (at - epoch).total_seconds()

    killed = {e.pid: s(e.at) for e in fleet.events if e.kind == "kill"}
    every: list[Execution] = [e for runs in verdict.executions.values() for e in runs]
    end_of_run = max(s(e.finished or e.started) for e in every)

    def ended(e: Execution) -> float:
        if e.finished is not None:
            return s(e.finished)
        return killed.get(e.pid, end_of_run)

    by_pid: dict[int, list[Execution]] = {}
    for e in every:
        by_pid.setdefault(e.pid, []).append(e)
    busy = {pid: Level((s(e.started), ended(e)) for e in runs) for pid, runs in by_pid.items()}
    up = {
        pid: (min(s(e.started) for e in runs), killed.get(pid, end_of_run))
        for pid, runs in by_pid.items()
    }
    limited = Level((s(e.started), ended(e)) for e in every if queue_of.get(e.job_id) == LIMITED)

    waits = []
    for job_id, queue, attempts, attempted_at, result, args in rows:
        accepted = [
            e
            for e in verdict.executions.get(int(job_id), [])
            if e.attempt == attempts and e.pid == result["pid"]
        ]
        if not accepted:
            continue  # judged by the verdict (stale or missing), not here
        run = accepted[0]
        claimed, started = s(attempted_at), s(run.started)
        others = [pid for pid in by_pid if pid != run.pid]
        points = {claimed, started}
        for pid in others:
            points.update(busy[pid].changes(claimed, started))
            points.update(t for t in up[pid] if claimed < t < started)
        if queue == LIMITED:
            points.update(limited.changes(claimed, started))
        ordered = sorted(points)
        held_back = stretch = 0.0
        for a, b in itertools.pairwise(ordered):
            free_elsewhere = any(
                up[pid][0] <= a < up[pid][1] and busy[pid].at(a) < SLOTS for pid in others
            )
            room = queue != LIMITED or limited.at(a) < LIMIT
            if free_elsewhere and room:
                stretch += b - a
                continue
            held_back += stretch if stretch >= TURNAROUND else 0.0
            stretch = 0.0
        held_back += stretch if stretch >= TURNAROUND else 0.0
        waits.append(
            Wait(
                int(job_id),
                run.pid,
                str(queue),
                float(args["ms"]),
                max(started - claimed, 0.0),
                held_back,
            )
        )
    return waits


@pytest.mark.timeout(TIMEOUT)
def test_mixed_durations_with_a_limited_queue_and_sigkills_hold_no_job_back(
    chaos_db: ChaosDatabase, fleet: Fleet, seed: int
) -> None:
    rng = random.Random(seed)
    client.set_queue_limits(chaos_db.conn, SCHEMA, LIMITED, concurrency=LIMIT)
    options: dict[str, Any] = {"queues": ",".join(QUEUES), "concurrency": SLOTS}
    fleet.start_many(WORKERS, chaos_db.conn, **options)
    ids = enqueue(chaos_db, mixed_jobs(rng))

    def kill_one() -> None:
        victim = registered_choice(chaos_db, fleet, rng)
        if victim is not None:
            fleet.kill(victim)
            fleet.start(**options)

    drain(chaos_db, fleet, kill_one, every=KILL_EVERY, deadline=DEADLINE)

    verdict = judge(chaos_db, ids)
    verdict.assert_sound(allowed={"WorkerLost"}, culprits={"WorkerLost": fleet.pids("kill")})
    assert verdict.dead == 0
    assert fleet.pids("kill"), "the queue drained before the first kill"

    waits = held_back_waits(chaos_db, fleet, verdict)
    assert len(waits) == JOBS
    worst = max(waits, key=lambda w: w.held_back)
    over = [w for w in waits if w.held_back > WAIT_BOUND + NOISE]
    figures = scenario_figures("mixed", verdict, fleet, seed, mix="1% 2 s, 0.1 ms")
    figures.update(
        worst_held_back_s=round(worst.held_back, 3),
        worst_held_back_job=f"{worst.job_id} ({worst.queue}, {worst.ms} ms, waited "
        f"{worst.waited:.3f} s at {worst.pid})",
        held_back_over_bound=len(over),
        worst_wait_s=round(max(w.waited for w in waits), 3),
    )
    record_figures(figures)
    assert over == [], (
        f"{len(over)} jobs waited at a worker more than {WAIT_BOUND + NOISE:.2f} s while the "
        f"other had a free slot; worst {worst}; figures {figures}"
    )
