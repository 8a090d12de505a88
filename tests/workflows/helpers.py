"""Reading a workflow's rows in the workflow tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

import skiplock
from conftest import wait_until
from semantics.conftest import Sem
from skiplock.sql import render


def enqueue(sem: Sem, workflow: skiplock.Workflow) -> skiplock.WorkflowRef:
    """Enqueue in a transaction of its own, committed."""
    with sem.connect(autocommit=False) as conn:
        ref = workflow.enqueue(conn)
        conn.commit()
    return ref


def complete_by_hand(conn: psycopg.Connection[Any], schema: str, ids: Sequence[int]) -> None:
    """A completion as the worker writes it: the rows into history, in one statement
    (whose DELETE ends the steps), with the result 1."""
    conn.execute(
        render(
            "WITH done AS (DELETE FROM {jobs} WHERE id = ANY(%s) RETURNING *) "
            "INSERT INTO {history} (id, queue, task, args, state, priority, attempts, "
            "max_attempts, errors, result, created_at) "
            "SELECT id, queue, task, args, 'completed', priority, attempts, max_attempts, "
            "errors, '1', created_at FROM done",
            schema,
        ),
        (list(ids),),
    )


def failing_task(sem: Sem, message: str) -> skiplock.Task[Any]:
    """A task "boom" of one attempt that always fails with ``message``."""

    @sem.app.task(name="boom", max_attempts=1)
    def boom() -> None:
        raise ValueError(message)

    return boom


def workflow_state(sem: Sem, workflow_id: int) -> str:
    rows = sem.execute("SELECT state FROM {schema}.workflows WHERE id = %s", (workflow_id,))
    return str(rows[0][0])


def wait_for_workflow(sem: Sem, workflow_id: int, state: str, timeout: float = 30.0) -> None:
    wait_until(lambda: workflow_state(sem, workflow_id) == state, timeout, f"the workflow {state}")


def step_states(sem: Sem, workflow_id: int) -> dict[str, str]:
    """Each step's job state by step name, live or from history."""
    rows = sem.execute(
        "SELECT s.name, coalesce(j.state, h.state) FROM {schema}.workflow_steps AS s "
        "LEFT JOIN {jobs} AS j ON j.id = s.job_id "
        "LEFT JOIN {history} AS h ON h.id = s.job_id "
        "WHERE s.workflow_id = %s",
        (workflow_id,),
    )
    return {str(name): str(state) for name, state in rows}
