"""Workflows of Django tasks: enqueued in the current atomic() block, run by a real worker,
each step seeing its parents' results."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

import skiplock
from skiplock import EnqueueError
from skiplock.contrib.django.backend import SkiplockBackend
from skiplock.contrib.django.compat import FRAMEWORK, InvalidTask, TaskResultStatus
from skiplock.contrib.django.workflows import enqueue_workflow, step
from tests_django.conftest import StartWorker, finished_result
from tests_django.taskapp import tasks

pytestmark = pytest.mark.django_db


def counts() -> tuple[int, int, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT count(*) FROM skiplock.workflows), "
            "(SELECT count(*) FROM skiplock.workflow_steps), (SELECT count(*) FROM skiplock.jobs)"
        )
        row = cursor.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_a_workflow_rolls_back_and_commits_with_atomic(backend: SkiplockBackend) -> None:
    class BoomError(Exception):
        pass

    with pytest.raises(BoomError), transaction.atomic():
        enqueue_workflow(skiplock.chain(step(tasks.add, 1, b=2), step(tasks.record, "x")))
        assert counts() == (1, 2, 2)
        raise BoomError
    assert counts() == (0, 0, 0)

    with transaction.atomic():
        ref = enqueue_workflow(
            skiplock.chain(step(tasks.add, 1, b=2), step(tasks.send_email.using(priority=5), "a"))
        )
    assert counts() == (1, 2, 2)
    first, second = (backend.get_result(str(int(r))) for r in ref.steps.values())
    assert list(ref.steps) == [
        "tests_django.taskapp.tasks.add",
        "tests_django.taskapp.tasks.send_email",
    ]
    assert (first.args, first.kwargs, first.status) == ([1], {"b": 2}, TaskResultStatus.READY)
    # A step waiting for its parent is READY, as a job waiting for its time is.
    assert second.status == TaskResultStatus.READY
    # The task's queue and the priority given by using(), as task.enqueue would write.
    assert (second.task.queue_name, second.task.priority, second.args) == ("emails", 5, ["a"])


def test_steps_run_after_their_parents_and_see_their_results(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    wf = skiplock.Workflow("django")
    a = wf.add(step(tasks.add, 2, b=3), name="sum")
    b = wf.add(step(tasks.send_email, "x@example.com"), name="mail")
    wf.add(step(tasks.gather, "end"), name="end", after=[a, b])
    with transaction.atomic():
        ref = enqueue_workflow(wf)
    start_worker()
    result = finished_result(backend, str(int(ref.steps["end"])), timeout=30)
    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert result.return_value == {
        "label": "end",
        "parents": {"sum": 5, "mail": {"to": "x@example.com", "subject": "hello"}},
    }


def test_bad_calls_are_refused_before_anything_is_written(backend: SkiplockBackend) -> None:
    with pytest.raises(EnqueueError, match=r"cannot enqueue tests_django\.taskapp\.tasks\.add"):
        step(tasks.add, 1, 2, 3)
    other = {"BACKEND": f"{FRAMEWORK}.backends.immediate.ImmediateBackend"}
    with override_settings(TASKS={**settings.TASKS, "other": other}):
        with pytest.raises(InvalidTask, match="workflows need"):
            step(tasks.add.using(backend="other"), 1)
        with pytest.raises(InvalidTask, match="workflows need"):
            enqueue_workflow(skiplock.chain(step(tasks.add, 1)), backend="other")
    assert counts() == (0, 0, 0)
