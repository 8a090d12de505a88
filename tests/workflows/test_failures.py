"""A step that ends dead cancels what depends on it (transitively), unless a step runs
anyway; retrying the dead step by hand resumes the workflow (decision 024)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import skiplock
from skiplock import client
from workflows.conftest import Calls, Sem, StartWorkers
from workflows.helpers import enqueue, failing_task, step_states, wait_for_workflow, workflow_state

pytestmark = pytest.mark.server_version


def _failed_diamond(
    sem: Sem, workers: StartWorkers, calls: Calls, fail: threading.Event
) -> skiplock.WorkflowRef:
    """root -> (bad -> after_bad -> last_bad), (good -> after_good); join after both,
    run by a worker until the workflow fails (bad fails while ``fail`` is set)."""
    fail.set()

    @sem.app.task(name="ok", max_attempts=1)
    def ok(label: str) -> str:
        calls.record(label)
        return label

    @sem.app.task(name="bad", max_attempts=1)
    def bad() -> str:
        calls.record("bad")
        if fail.is_set():
            raise RuntimeError("bad step")
        return "fixed"

    wf = sem.app.workflow("diamond")
    root = wf.add(ok.job(label="root"), name="root")
    b = wf.add(bad.job(), name="bad", after=[root])
    after_bad = wf.add(ok.job(label="after_bad"), name="after_bad", after=[b])
    wf.add(ok.job(label="last_bad"), name="last_bad", after=[after_bad])
    good = wf.add(ok.job(label="good"), name="good", after=[root])
    after_good = wf.add(ok.job(label="after_good"), name="after_good", after=[good])
    wf.add(ok.job(label="join"), name="join", after=[after_bad, after_good])
    ref = enqueue(sem, wf)
    workers(1)
    wait_for_workflow(sem, ref.id, "failed")
    return ref


def test_a_dead_step_cancels_its_dependents_and_the_workflow_fails(
    sem: Sem, workers: StartWorkers
) -> None:
    calls, fail = Calls(), threading.Event()
    ref = _failed_diamond(sem, workers, calls, fail)
    assert step_states(sem, ref.id) == {
        "root": "completed",
        "bad": "dead",
        "after_bad": "cancelled",
        "last_bad": "cancelled",
        "join": "cancelled",
        "good": "completed",
        "after_good": "completed",
    }
    assert set(calls.counts) == {"root", "bad", "good", "after_good"}
    cancelled = sem.job(ref.steps["last_bad"])
    assert cancelled.errors[-1]["type"] == "ParentFailed"
    with pytest.raises(skiplock.JobFailedError):
        ref.steps["join"].result(5)
    row = sem.execute(
        "SELECT steps, steps_left, steps_failed, finished_at IS NOT NULL "
        "FROM {schema}.workflows WHERE id = %s",
        (ref.id,),
    )
    assert row == [(7, 0, 4, True)]


def test_retrying_the_dead_step_resumes_the_workflow(sem: Sem, workers: StartWorkers) -> None:
    calls, fail = Calls(), threading.Event()
    ref = _failed_diamond(sem, workers, calls, fail)
    fail.clear()
    with sem.connect() as conn:
        client.retry_job(conn, sem.schema, ref.steps["bad"])
    wait_for_workflow(sem, ref.id, "completed")
    assert set(step_states(sem, ref.id).values()) == {"completed"}
    assert calls.counts["bad"] == 2
    assert calls.counts["join"] == 1
    assert calls.counts["after_bad"] == 1
    # The steps came back under their own ids: each job's refs still hold.
    assert ref.steps["join"].result(5) == "join"
    row = sem.execute(
        "SELECT steps_left, steps_failed FROM {schema}.workflows WHERE id = %s", (ref.id,)
    )
    assert row == [(0, 0)]


def test_a_step_that_runs_anyway_sees_the_failure(sem: Sem, workers: StartWorkers) -> None:
    boom = failing_task(sem, "no data")

    @sem.app.task(name="fine")
    def fine() -> int:
        return 7

    @sem.app.task(name="report")
    def report() -> dict[str, Any]:
        parents = skiplock.parent_results()
        return {
            name: (type(value).__name__, str(value)) if isinstance(value, Exception) else value
            for name, value in parents.items()
        }

    wf = sem.app.workflow("anyway")
    a = wf.add(boom.job(), name="boom")
    b = wf.add(fine.job(), name="fine")
    wf.add(report.job(), name="report", after=[a, b], run_anyway=True)
    ref = enqueue(sem, wf)
    workers(1)
    result = ref.steps["report"].result(15)
    assert result["fine"] == 7
    kind, message = result["boom"]
    assert kind == "JobFailedError"
    assert "dead" in message and "no data" in message
    wait_for_workflow(sem, ref.id, "failed")


def test_run_anyway_for_the_whole_workflow(sem: Sem, workers: StartWorkers) -> None:
    boom = failing_task(sem, "no")

    @sem.app.task(name="after")
    def after() -> str:
        return "ran"

    wf = sem.app.workflow("all anyway", run_anyway=True)
    first = wf.add(boom.job())
    second = wf.add(after.job(), after=[first])
    wf.add(after.job(), after=[second])
    ref = enqueue(sem, wf)
    workers(1)
    wait_for_workflow(sem, ref.id, "failed")
    assert step_states(sem, ref.id) == {
        "boom": "dead",
        "after": "completed",
        "after#2": "completed",
    }


def test_cancelling_a_waiting_step_by_hand_cancels_what_depends_on_it(sem: Sem) -> None:
    @sem.app.task(name="noop")
    def noop() -> None: ...

    wf = skiplock.chain(noop.job(), noop.job(), noop.job(), app=sem.app)
    ref = enqueue(sem, wf)
    with sem.connect() as conn:
        client.cancel_job(conn, sem.schema, ref.steps["noop#2"])
    assert sem.state_of(ref.steps["noop#2"]) == "cancelled"
    assert sem.state_of(ref.steps["noop#3"]) == "cancelled"
    assert sem.state_of(ref.steps["noop"]) == "available"
    assert workflow_state(sem, ref.id) == "running"
    with sem.connect() as conn:  # deleted, leaving no history: ended all the same
        client.delete_job(conn, sem.schema, ref.steps["noop"])
    assert workflow_state(sem, ref.id) == "failed"
