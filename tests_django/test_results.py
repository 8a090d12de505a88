"""Task results read back: from live jobs and from history, with status, times, errors,
workers, attempts and the return value, run by a real skiplock worker."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from django.utils import timezone

from skiplock import client
from skiplock.contrib.django.backend import SkiplockBackend
from skiplock.contrib.django.compat import TaskResultDoesNotExist, TaskResultStatus
from skiplock.errors import UnknownTaskError
from skiplock.tasks import JobSpec
from tests_django.conftest import StartWorker, finished_result, wait_until
from tests_django.taskapp import tasks
from tests_django.taskapp.models import Ran


def test_a_successful_result(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    before = timezone.now()
    enqueued = tasks.send_email.enqueue("ann@example.com", subject="receipt")
    worker = start_worker()

    result = finished_result(backend, enqueued.id)

    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"to": "ann@example.com", "subject": "receipt"}
    assert (result.args, result.kwargs) == (["ann@example.com"], {"subject": "receipt"})
    assert result.worker_ids == [str(worker.worker.id)]
    assert result.attempts == 1
    assert result.errors == []
    assert result.task.func is tasks.send_email.func
    assert result.task.queue_name == "emails"
    times = [result.enqueued_at, result.started_at, result.finished_at]
    assert all(t is not None and t.tzinfo is not None for t in times)
    assert before - dt.timedelta(seconds=5) <= times[0] <= times[1] <= times[2]
    assert result.last_attempted_at == result.started_at
    # The same through the task, and refreshed in place.
    assert tasks.send_email.get_result(enqueued.id).status == TaskResultStatus.SUCCESSFUL
    enqueued.refresh()
    assert enqueued.status == TaskResultStatus.SUCCESSFUL
    assert enqueued.return_value == result.return_value


def test_a_failed_result_has_each_attempts_error_and_worker(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    enqueued = tasks.fail.enqueue("card declined")
    worker = start_worker()

    result = finished_result(backend, enqueued.id)

    assert result.status == TaskResultStatus.FAILED
    assert result.attempts == 2  # MAX_ATTEMPTS in the test settings
    assert result.worker_ids == [str(worker.worker.id)] * 2
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"] * 2
    assert result.errors[0].exception_class is ValueError
    assert "ValueError: card declined" in result.errors[-1].traceback
    assert "in fail" in result.errors[-1].traceback
    assert result.finished_at is not None and result.finished_at >= result.started_at
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value


def test_takes_context_gets_the_live_result_and_retries_see_their_history(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    first = tasks.introspect.enqueue(7)
    second = tasks.flaky.enqueue("f")
    worker = start_worker()
    me = str(worker.worker.id)

    seen = finished_result(backend, first.id).return_value
    assert seen == {
        "attempt": 1,
        "id": first.id,
        "status": "RUNNING",
        "worker_ids": [me],
        "args": [7],
        "kwargs": {},
    }
    retried = finished_result(backend, second.id)
    assert retried.status == TaskResultStatus.SUCCESSFUL
    assert retried.return_value == {
        "attempt": 2,
        "id": second.id,
        "status": "RUNNING",
        "worker_ids": [me, me],
        "errors": ["builtins.RuntimeError"],
        "args": ["f"],
    }
    assert [e.exception_class_path for e in retried.errors] == ["builtins.RuntimeError"]
    assert list(Ran.objects.order_by("id").values_list("attempt", flat=True)) == [1, 2]


def test_a_running_task_reads_as_running(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    tasks.RELEASE.clear()
    enqueued = tasks.hold.enqueue()
    worker = start_worker()
    try:
        wait_until(
            lambda: backend.get_result(enqueued.id).status == TaskResultStatus.RUNNING,
            15.0,
            "the task to start",
        )
        running = backend.get_result(enqueued.id)
        assert running.started_at is not None and running.finished_at is None
        assert running.worker_ids == [str(worker.worker.id)]
        with pytest.raises(ValueError, match="not finished"):
            _ = running.return_value
    finally:
        tasks.RELEASE.set()
    assert finished_result(backend, enqueued.id).return_value == "released"


def test_run_after_holds_the_task_back(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    run_after = timezone.now() + dt.timedelta(seconds=1.5)
    enqueued = tasks.add.using(run_after=run_after).enqueue(1, 2)
    start_worker()

    assert backend.get_result(enqueued.id).status == TaskResultStatus.READY
    result = finished_result(backend, enqueued.id)
    assert result.return_value == 3
    assert result.started_at >= run_after


def test_higher_priority_runs_first(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    for label, priority in [("low", -5), ("default", 0), ("high", 100), ("mid", 20)]:
        tasks.record.using(priority=priority).enqueue(label)
    last = tasks.record.using(priority=-100).enqueue("last")
    start_worker(concurrency=1, prefetch=0)

    finished_result(backend, last.id)
    assert list(Ran.objects.order_by("id").values_list("label", flat=True)) == [
        "high",
        "mid",
        "default",
        "low",
        "last",
    ]


def test_async_tasks_run_on_the_workers_loop(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    enqueued = tasks.async_add.enqueue(20, 22)
    start_worker()

    assert finished_result(backend, enqueued.id).return_value == 42
    assert list(Ran.objects.values_list("label", flat=True)) == ["async 20+22"]


def test_a_job_naming_no_task_fails_with_a_clear_error(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    with psycopg.connect(database_url) as conn:
        missing = client.insert_job(
            conn,
            "skiplock",
            JobSpec(
                "tests_django.taskapp.tasks.nothing_here",
                '{"args": [], "kwargs": {}}',
                "default",
                0,
                1,
            ),
        )[0]
        plain = client.insert_job(
            conn,
            "skiplock",
            JobSpec(
                "tests_django.taskapp.tasks.plain_function",
                '{"args": [], "kwargs": {}}',
                "default",
                0,
                1,
            ),
        )[0]
    start_worker()

    with psycopg.connect(database_url, autocommit=True) as conn:

        def dead(job_id: int) -> client.Job | None:
            job = client.get_job(conn, "skiplock", job_id)
            return job if str(job.state) == "dead" else None

        wait_until(lambda: dead(missing) and dead(plain), 15.0, "both jobs to fail")
        [error] = client.get_job(conn, "skiplock", missing).errors
        assert error["type"] == UnknownTaskError.__name__
        assert "no Django task 'tests_django.taskapp.tasks.nothing_here'" in error["message"]
        [error] = client.get_job(conn, "skiplock", plain).errors
        assert "is not a Django task" in error["message"]
    with pytest.raises(TaskResultDoesNotExist, match="cannot be imported"):
        backend.get_result(str(missing))


def test_unknown_and_pruned_results_do_not_exist(
    backend: SkiplockBackend, start_worker: StartWorker, database_url: str
) -> None:
    enqueued = tasks.add.enqueue(1)
    start_worker()
    finished_result(backend, enqueued.id)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM skiplock.job_history WHERE id = %s", (int(enqueued.id),))

    for result_id in (enqueued.id, "999999", "not-a-number"):
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result(result_id)
