"""Steps carry the options of any job: transactional handlers, keys, delays, queues."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

import skiplock
from workflows.conftest import Sem, StartWorkers
from workflows.helpers import enqueue, step_states, wait_for_workflow

pytestmark = pytest.mark.server_version


def test_transactional_steps_release_their_children_when_their_batch_commits(
    sem: Sem, workers: StartWorkers
) -> None:
    """A transactional step's outcome is written in its own transaction: the child is
    released by that write, and its parent's database effects committed with it."""
    sem.execute("CREATE TABLE {schema}.effects (label text)")

    @sem.app.task(name="write", transactional=True)
    def write(conn: psycopg.Connection[Any], label: str) -> str:
        conn.execute(
            psycopg.sql.SQL("INSERT INTO {} VALUES (%s)").format(
                psycopg.sql.Identifier(sem.schema, "effects")
            ),
            (label,),
        )
        return label

    @sem.app.task(name="read", transactional=True)
    def read(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        rows = conn.execute(
            psycopg.sql.SQL("SELECT label FROM {} ORDER BY label").format(
                psycopg.sql.Identifier(sem.schema, "effects")
            )
        ).fetchall()
        return {"rows": [r[0] for r in rows], "parents": skiplock.parent_results(conn)}

    wf = skiplock.chord(
        skiplock.group(write.job(label="x"), write.job(label="y")), read.job(), app=sem.app
    )
    ref = enqueue(sem, wf)
    workers(1)
    assert ref.steps["read"].result(15) == {
        "rows": ["x", "y"],
        "parents": {"write": "x", "write#2": "y"},
    }
    wait_for_workflow(sem, ref.id, "completed")


def test_a_dead_transactional_step_cancels_its_child(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="fails", transactional=True, max_attempts=1)
    def fails(conn: psycopg.Connection[Any]) -> None:
        raise RuntimeError("no")

    @sem.app.task(name="never")
    def never() -> None:
        raise AssertionError("a child of a dead step ran")

    with sem.connect(autocommit=False) as conn:
        ref = skiplock.chain(fails.job(), never.job(), app=sem.app).enqueue(conn)
        conn.commit()
    workers(1)
    wait_for_workflow(sem, ref.id, "failed")
    assert step_states(sem, ref.id) == {"fails": "dead", "never": "cancelled"}


def test_a_keyed_step_is_released_into_its_keys_line(sem: Sem, workers: StartWorkers) -> None:
    """Released, a keyed step joins its key's line (blocked) and runs when admitted: not
    while another job of its key runs."""

    @sem.app.task(name="first")
    def first() -> str:
        return "first"

    @sem.app.task(name="keyed")
    def keyed(label: str) -> str:
        return label

    wf = sem.app.workflow("keyed")
    a = wf.add(first.job())
    wf.add(keyed.with_options(ordering_key="k").job(label="step"), name="step", after=[a])
    ref = enqueue(sem, wf)
    assert sem.state_of(ref.steps["step"]) == "waiting"
    workers(1)
    assert ref.steps["step"].result(20) == "step"
    wait_for_workflow(sem, ref.id, "completed")
    assert sem.job(ref.steps["step"]).state == skiplock.JobState.COMPLETED


def test_a_delayed_step_released_early_waits_for_its_time(sem: Sem) -> None:
    """Released before its run_at, a step is scheduled, as an enqueue writes it."""

    @sem.app.task(name="noop")
    def noop() -> None: ...

    wf = sem.app.workflow()
    a = wf.add(noop.job())
    wf.add(noop.with_options(delay=3600).job(), name="later", after=[a])
    ref = enqueue(sem, wf)
    sem.execute(
        "WITH done AS (DELETE FROM {jobs} WHERE id = %s RETURNING *) "
        "INSERT INTO {history} (id, queue, task, args, state, priority, attempts, "
        "max_attempts, errors, created_at) SELECT id, queue, task, args, 'completed', "
        "priority, attempts, max_attempts, errors, created_at FROM done",
        (ref.steps["noop"],),
    )
    assert sem.state_of(ref.steps["later"]) == "scheduled"


def test_ten_thousand_steps_enqueue_in_one_statement(sem: Sem) -> None:
    """A fan-out of 9,998 steps between one root and one fan-in: every step written, the
    edges mapped to the right ids."""

    @sem.app.task(name="noop")
    def noop(n: int) -> None: ...

    wf = sem.app.workflow("wide")
    root = wf.add(noop.job(n=0), name="root")
    middle = [wf.add(noop.job(n=n), name=f"m{n}", after=[root]) for n in range(1, 9999)]
    wf.add(noop.job(n=9999), name="last", after=middle)
    started = time.perf_counter()
    ref = enqueue(sem, wf)
    print(f"10,000 steps enqueued in {time.perf_counter() - started:.3f} s")
    assert len(ref.steps) == 10_000
    rows = sem.execute(
        "SELECT j.args ->> 'n', s.name, cardinality(s.parents), cardinality(s.children), "
        "s.pending, j.state FROM {schema}.workflow_steps AS s JOIN {jobs} AS j "
        "ON j.id = s.job_id WHERE s.job_id = ANY(%s)",
        ([ref.steps["root"], ref.steps["m500"], ref.steps["last"]],),
    )
    assert sorted(rows) == [
        ("0", "root", 0, 9998, 0, "available"),
        ("500", "m500", 1, 1, 1, "waiting"),
        ("9999", "last", 9998, 0, 9998, "waiting"),
    ]
    names = sem.execute(
        "SELECT count(*) FROM {schema}.workflow_steps AS s JOIN {jobs} AS j ON j.id = s.job_id "
        "WHERE s.workflow_id = %s AND s.name = CASE WHEN j.args ->> 'n' = '0' THEN 'root' "
        "WHEN j.args ->> 'n' = '9999' THEN 'last' ELSE 'm' || (j.args ->> 'n') END",
        (ref.id,),
    )
    assert names == [(10_000,)]


def test_a_unique_step_holds_its_key_while_it_waits_and_a_held_key_refuses_the_workflow(
    sem: Sem, workers: StartWorkers
) -> None:
    @sem.app.task(name="first")
    def first() -> None: ...

    @sem.app.task(name="report", unique=True)
    def report(day: str) -> str:
        return day

    wf = skiplock.chain(first.job(), report.job(day="mon"), app=sem.app)
    ref = enqueue(sem, wf)
    waiting = int(ref.steps["report"])
    assert sem.state_of(waiting) == "waiting"
    # A plain enqueue of the same key gets the waiting step back, as it would any holder.
    again = sem.enqueue(report, day="mon")
    assert (int(again), again.duplicate) == (waiting, True)
    # A workflow whose step's key is held is refused whole; nothing of it is written.
    with sem.connect(autocommit=False) as conn:
        with pytest.raises(skiplock.EnqueueError, match="unique step's key is held"):
            skiplock.chain(first.job(), report.job(day="mon"), app=sem.app).enqueue(conn)
        conn.rollback()
    assert sem.execute("SELECT count(*) FROM {schema}.workflows")[0][0] == 1
    workers(1)
    wait_for_workflow(sem, ref.id, "completed")
    # Ended, the key is free for the next workflow.
    ref2 = enqueue(sem, skiplock.chain(report.job(day="mon"), app=sem.app))
    wait_for_workflow(sem, ref2.id, "completed")
    assert ref2.steps["report"].result(5) == "mon"
