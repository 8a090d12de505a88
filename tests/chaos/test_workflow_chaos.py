"""Workflows under chaos (issue 23): chains, diamonds, chords and one large fan-in, drained
by four worker processes while one of them is SIGKILLed every second, or while the server
crashes and comes back (a private PostgreSQL 18).

What every chaos scenario checks holds for each step (none lost, none completed twice,
every re-run explained by a kill). Besides: every workflow ends completed, and no step
started before each of its parents had completed (the child's first start, the handler's
clock, against the parent's ``finished_at``, which the completing transaction stamps
before it commits: same host, same clock). A child released twice would run twice,
unexplained; one released early would start before its parent's completion.

The size follows ``SKIPLOCK_CHAOS_JOBS``: at the default (CI), 40 workflows and a fan-in
of 100 parents; with ``scripts/chaos --jobs 20000``, 200 workflows and 1,000 parents.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

import pytest

import skiplock

from .chaos_app import app, work_async, work_sync
from .conftest import (
    DEFAULT_JOBS,
    JOBS,
    SCHEMA,
    ChaosDatabase,
    Fleet,
    PrivateServer,
    record_figures,
)
from .test_chaos import (
    LOST_CLAIM,
    TIMEOUT,
    Verdict,
    crash_after,
    drain,
    explain_lost_claims,
    judge,
    registered_choice,
    scenario_figures,
)

pytestmark = pytest.mark.chaos

WORKERS = 4
CONCURRENCY = 6
LARGE = JOBS > DEFAULT_JOBS
WORKFLOWS = 200 if LARGE else 40
FAN_IN = 1000 if LARGE else 100
# Long enough that the drain spans several kills at the default size: about 300 steps of
# 250 ms on 24 slots, with chains five deep, is some four seconds of work.
SHORT_MS = (100, 400)


@dataclass
class Built:
    """The workflows to enqueue, and each step's parents by (workflow, step name)."""

    workflows: list[skiplock.Workflow] = field(default_factory=list)
    parents: dict[tuple[int, str], list[str]] = field(default_factory=dict)


def _step(rng: random.Random) -> skiplock.JobSpec:
    ms = rng.randint(*SHORT_MS)
    return work_sync.job(ms=ms) if rng.random() < 0.5 else work_async.job(ms=ms)


def build(rng: random.Random) -> Built:
    built = Built()

    def add(name: str, after: list[str]) -> None:
        index = len(built.workflows) - 1
        workflow = built.workflows[index]
        workflow.add(_step(rng), name=name, after=after)
        built.parents[index, name] = after

    for n in range(WORKFLOWS):
        built.workflows.append(app.workflow(f"chaos-{n}"))
        shape = n % 3
        if shape == 0:  # a chain of five
            for i in range(5):
                add(f"c{i}", [f"c{i - 1}"] if i else [])
        elif shape == 1:  # a diamond
            add("top", [])
            add("left", ["top"])
            add("right", ["top"])
            add("bottom", ["left", "right"])
        else:  # a chord: five side by side, then one after them all
            for i in range(5):
                add(f"g{i}", [])
            add("callback", [f"g{i}" for i in range(5)])
    built.workflows.append(app.workflow("chaos-fan-in"))
    for i in range(FAN_IN):
        add(f"p{i}", [])
    add("child", [f"p{i}" for i in range(FAN_IN)])
    return built


def edges(built: Built, refs: list[skiplock.WorkflowRef]) -> Iterator[tuple[int, int]]:
    """(parent job id, child job id) of every edge."""
    for (index, name), parents in built.parents.items():
        steps = refs[index].steps
        for parent in parents:
            yield int(steps[parent]), int(steps[name])


@pytest.mark.timeout(240)
def test_workflows_under_sigkill_every_second_release_each_step_once_after_its_parents(
    chaos_db: ChaosDatabase, fleet: Fleet, seed: int
) -> None:
    rng = random.Random(seed)
    built = build(rng)
    fleet.start_many(WORKERS, chaos_db.conn, concurrency=CONCURRENCY)
    with chaos_db.conn.transaction():
        refs = [workflow.enqueue(chaos_db.conn) for workflow in built.workflows]
    ids = [int(ref) for wf in refs for ref in wf.steps.values()]

    def kill_one() -> None:
        victim = registered_choice(chaos_db, fleet, rng)
        if victim is not None:
            fleet.kill(victim)
            fleet.start(concurrency=CONCURRENCY)

    drain(chaos_db, fleet, kill_one, every=1.0, deadline=180.0)

    verdict = judge(chaos_db, ids)
    verdict.assert_sound(allowed={"WorkerLost"}, culprits={"WorkerLost": fleet.pids("kill")})
    assert verdict.completed == len(ids) and verdict.dead == 0
    assert any(e.kind == "kill" for e in fleet.events), "the queue drained before the first kill"

    assert_released_in_order(chaos_db, built, refs, verdict)
    figures = scenario_figures("workflows", verdict, fleet, seed)
    figures.update(workflows=len(refs), fan_in=FAN_IN, steps=len(ids))
    record_figures(figures)


def assert_released_in_order(
    db: ChaosDatabase, built: Built, refs: list[skiplock.WorkflowRef], verdict: Verdict
) -> None:
    """No step started before each of its parents had completed, and every workflow
    ended completed, with no step left."""
    ids = [int(ref) for wf in refs for ref in wf.steps.values()]
    finished: dict[int, datetime] = dict(
        db.conn.execute(
            f"SELECT id, finished_at FROM {SCHEMA}.job_history WHERE id = ANY(%s)", (ids,)
        ).fetchall()
    )
    early = [
        (parent, child)
        for parent, child in edges(built, refs)
        if min(e.started for e in verdict.executions[child]) <= finished[parent]
    ]
    assert early == [], f"steps started before a parent completed: {early[:10]}"
    states = db.conn.execute(
        f"SELECT state, steps_left, count(*) FROM {SCHEMA}.workflows WHERE id = ANY(%s)"
        " GROUP BY state, steps_left",
        ([ref.id for ref in refs],),
    ).fetchall()
    assert states == [("completed", 0, len(refs))], states


@pytest.mark.timeout(TIMEOUT)
def test_workflows_ride_out_a_server_restart_mid_drain(
    private_db: tuple[PrivateServer, ChaosDatabase],
    fleet_factory: Callable[[str], Fleet],
    seed: int,
) -> None:
    """The server crashes (immediate shutdown: no checkpoint, every session cut) with a
    third of the steps done; every step still runs, none before its parents, and every
    workflow completes. Re-runs are explained by the crash: attempts whose workers lost
    their sessions, and claims whose answers were lost with them."""
    server, db = private_db
    fleet = fleet_factory(db.url)
    rng = random.Random(seed)
    built = build(rng)
    fleet.start_many(WORKERS, db.conn, concurrency=CONCURRENCY, lease=6.0)
    with db.conn.transaction():
        refs = [workflow.enqueue(db.conn) for workflow in built.workflows]
    ids = [int(ref) for wf in refs for ref in wf.steps.values()]
    crashed_at, _ = crash_after(server, db, fleet, len(ids) // 3)
    drain(db, fleet)

    verdict = judge(db, ids)
    lost_claims = explain_lost_claims(verdict, crashed_at)
    verdict.assert_sound(
        allowed={"WorkerLost", "LeaseExpired", "Reconciled", LOST_CLAIM},
        culprits={"WorkerLost": {w.pid for w in fleet.workers}},
    )
    assert verdict.completed == len(ids) and verdict.dead == 0
    assert_released_in_order(db, built, refs, verdict)
    figures = scenario_figures("workflows-restart", verdict, fleet, seed)
    figures.update(workflows=len(refs), steps=len(ids), claims_lost_in_crash=lost_claims)
    record_figures(figures)
