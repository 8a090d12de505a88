"""Steps wait for their parents and are released by the statement that ends the last one
(decision 024), with real workers."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from skiplock.sql import complete
from workflows.conftest import Calls, Sem, StartWorkers
from workflows.helpers import (
    complete_by_hand,
    enqueue,
    step_states,
    wait_for_workflow,
    workflow_state,
)

pytestmark = pytest.mark.server_version


def test_a_chain_runs_in_order_and_each_step_sees_its_parent(
    sem: Sem, workers: StartWorkers
) -> None:
    order: list[str] = []
    seen: dict[str, Any] = {}

    @sem.app.task(name="step")
    def step(label: str) -> str:
        order.append(label)
        seen[label] = skiplock.parent_results()
        return label.upper()

    wf = skiplock.chain(step.job(label="a"), step.job(label="b"), step.job(label="c"), app=sem.app)
    ref = enqueue(sem, wf)
    assert list(ref.steps) == ["step", "step#2", "step#3"]
    assert [sem.state_of(i) for i in ref.steps.values()] == ["available", "waiting", "waiting"]
    workers(1)
    wait_for_workflow(sem, ref.id, "completed")
    assert order == ["a", "b", "c"]
    assert seen == {"a": {}, "b": {"step": "A"}, "c": {"step#2": "B"}}
    assert ref.steps["step#3"].result(5) == "C"


@pytest.mark.timeout(180)
def test_a_fan_in_whose_parents_finish_together_releases_its_child_once(
    sem: Sem, workers: StartWorkers
) -> None:
    """Eight parents wait for each other at a barrier on four workers of two slots, so
    they end at the same moment, in different workers' completion batches; the child
    runs once, in each of five rounds."""
    calls = Calls()
    barrier = threading.Barrier(8, timeout=30)

    @sem.app.task(name="parent")
    def parent(n: int) -> int:
        barrier.wait()
        return n

    @sem.app.task(name="child")
    def child(round_: int) -> dict[str, Any]:
        calls.record(round_)
        return skiplock.parent_results()

    workers(4, concurrency=2)
    for round_ in range(5):
        wf = sem.app.workflow(f"fan-in {round_}")
        parents = [wf.add(parent.job(n=n), name=f"p{n}") for n in range(8)]
        wf.add(child.job(round_=round_), name="child", after=parents)
        with sem.connect(autocommit=False) as conn:
            ref = wf.enqueue(conn)
            conn.commit()
        wait_for_workflow(sem, ref.id, "completed", timeout=60)
        assert ref.steps["child"].result(5) == {f"p{n}": n for n in range(8)}
        barrier.reset()
    assert calls.counts == {r: 1 for r in range(5)}


def test_two_parents_ending_in_concurrent_transactions_release_the_child_once(
    sem: Sem,
) -> None:
    """The second ender waits on the child's row lock, then decrements what the first
    committed: exactly one of them releases it, whichever commits first."""

    @sem.app.task(name="noop")
    def noop() -> None: ...

    wf = sem.app.workflow()
    b = wf.add(noop.job(), name="b")
    c = wf.add(noop.job(), name="c")
    wf.add(noop.job(), name="d", after=[b, c])
    ref = enqueue(sem, wf)
    with sem.connect(autocommit=False) as first, sem.connect(autocommit=False) as second:
        complete_by_hand(first, sem.schema, [ref.steps["b"]])
        done = threading.Event()
        errors: list[BaseException] = []

        def end_c() -> None:
            try:
                complete_by_hand(second, sem.schema, [ref.steps["c"]])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
            done.set()

        thread = threading.Thread(target=end_c)
        thread.start()
        pid = second.info.backend_pid
        wait_until(lambda: sem.waiting_on_lock(pid), 10, "the second ender to wait")
        assert sem.state_of(ref.steps["d"]) == "waiting"
        first.commit()
        assert done.wait(10)
        thread.join()
        assert errors == []
        second.commit()
    assert sem.state_of(ref.steps["d"]) == "available"
    pending = sem.execute(
        "SELECT pending FROM {schema}.workflow_steps WHERE job_id = %s", (ref.steps["d"],)
    )
    assert pending == [(0,)]


def test_rolling_back_the_enqueue_leaves_nothing(sem: Sem) -> None:
    @sem.app.task(name="noop")
    def noop() -> None: ...

    with sem.connect(autocommit=False) as conn:
        ref = skiplock.chain(noop.job(), noop.job(), app=sem.app).enqueue(conn)
        assert sem.execute("SELECT count(*) FROM {schema}.workflows") == [(0,)]  # not yet seen
        conn.rollback()
    assert sem.live_count() == 0
    assert sem.execute("SELECT count(*) FROM {schema}.workflows") == [(0,)]
    assert sem.execute("SELECT count(*) FROM {schema}.workflow_steps") == [(0,)]
    assert ref.id > 0


def test_async_enqueue_and_async_parent_results(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="first")
    async def first() -> int:
        return 41

    @sem.app.task(name="second")
    async def second() -> int:
        parents = await skiplock.parent_results_async()
        return int(parents["first"]) + 1

    async def enqueue() -> skiplock.WorkflowRef:
        async with await psycopg.AsyncConnection.connect(sem.url) as conn:
            ref = await skiplock.chain(first.job(), second.job(), app=sem.app).enqueue_async(conn)
            await conn.commit()
            return ref

    ref = asyncio.run(enqueue())
    workers(1)
    assert ref.steps["second"].result(15) == 42
    assert workflow_state(sem, ref.id) == "completed"


def test_groups_chords_and_chains_compose(sem: Sem, workers: StartWorkers) -> None:
    """chain(a, group(b, c), chord(group(d, e), f)): the groups run after a, the chord's
    group after both, f after d and e."""

    @sem.app.task(name="s")
    def s(label: str) -> str:
        return label

    @sem.app.task(name="join")
    def join() -> list[str]:
        return sorted(str(v) for v in skiplock.parent_results().values())

    wf = skiplock.chain(
        s.job(label="a"),
        skiplock.group(s.job(label="b"), s.job(label="c")),
        skiplock.chord(skiplock.group(s.job(label="d"), s.job(label="e")), join.job()),
        app=sem.app,
    )
    ref = enqueue(sem, wf)
    parents = dict(
        sem.execute(
            "SELECT s.name, ARRAY(SELECT p.name FROM {schema}.workflow_steps AS p "
            "WHERE p.workflow_id = s.workflow_id AND p.step = ANY(s.parents) "
            "ORDER BY p.name) "
            "FROM {schema}.workflow_steps AS s WHERE s.workflow_id = %s",
            (ref.id,),
        )
    )
    assert parents == {
        "s": [],
        "s#2": ["s"],
        "s#3": ["s"],
        "s#4": ["s#2", "s#3"],
        "s#5": ["s#2", "s#3"],
        "join": ["s#4", "s#5"],
    }
    workers(1)
    wait_for_workflow(sem, ref.id, "completed")
    assert ref.steps["join"].result(5) == ["d", "e"]
    assert set(step_states(sem, ref.id).values()) == {"completed"}


def test_only_the_completion_the_fence_lets_through_releases_the_child(sem: Sem) -> None:
    """The lease-mode completion of a stale attempt (its job was rescued and claimed
    again) writes nothing, and so releases nothing; the current attempt's does."""

    @sem.app.task(name="noop")
    def noop() -> None: ...

    ref = enqueue(sem, skiplock.chain(noop.job(), noop.job(), app=sem.app))
    parent, child = ref.steps["noop"], ref.steps["noop#2"]
    worker = uuid.uuid4()
    sem.execute(
        "UPDATE {jobs} SET state = 'running', attempts = 2, worker_id = %s, "
        "lease_expires_at = now() + interval '1 minute' WHERE id = %s",
        (worker, parent),
    )

    def complete_attempt(attempt: int) -> list[Any]:
        return sem.execute(
            complete.JOB_COMPLETE_MANY_IF_LEASED,
            {
                "ids": [parent],
                "batch": json.dumps({str(parent): {"attempt": attempt, "result": "1"}}),
                "worker_id": worker,
            },
        )

    assert complete_attempt(1) == []  # the stale attempt: refused
    assert sem.state_of(child) == "waiting"
    assert complete_attempt(2) == [(parent,)]
    assert sem.state_of(child) == "available"
    assert complete_attempt(2) == []  # once only
    assert sem.execute(
        "SELECT pending FROM {schema}.workflow_steps WHERE job_id = %s", (child,)
    ) == [(0,)]


def test_a_schema_not_migrated_is_named_with_the_command_that_makes_it(sem: Sem) -> None:
    """As for a single job: SchemaNotReadyError, not psycopg's missing table."""
    bare = skiplock.App(sem.app.database_url, schema="not_migrated_here")

    @bare.task(name="bare")
    def bare_task() -> None: ...

    with (
        sem.connect() as conn,
        pytest.raises(skiplock.SchemaNotReadyError, match="skiplock migrate"),
    ):
        skiplock.chain(bare_task.job(), bare_task.job(), app=bare).enqueue(conn)
