"""Enqueueing Django tasks: in the caller's transaction, with the task's options, and the
framework's own errors for bad input."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone
from psycopg.rows import dict_row
from psycopg.types.json import JsonbLoader

from skiplock import EnqueueError, Job, SchemaNotReadyError, client
from skiplock.contrib.django.backend import SkiplockBackend
from skiplock.contrib.django.compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
)
from skiplock.sql import admin, render
from tests_django.taskapp import tasks
from tests_django.taskapp.models import Ran

pytestmark = pytest.mark.django_db


def raw_job(job_id: str) -> Job:
    """The job as skiplock reads it, through the test's own (uncommitted) transaction."""
    connection.ensure_connection()
    with connection.connection.cursor(row_factory=dict_row) as cursor:
        cursor.adapters.register_loader("jsonb", JsonbLoader)  # Django's loads text
        row = cursor.execute(render(admin.JOB_GET, "skiplock"), {"id": int(job_id)}).fetchone()
    assert row is not None
    return client.job_from_row(row)


def test_a_job_is_a_row_in_the_current_transaction(backend: SkiplockBackend) -> None:
    result = tasks.add.enqueue(2, b=3)

    assert result.status == TaskResultStatus.READY
    assert result.backend == "default"
    assert (result.args, result.kwargs) == ([2], {"b": 3})
    job = raw_job(result.id)
    assert job.task == "tests_django.taskapp.tasks.add"
    assert job.args == {"args": [2], "kwargs": {"b": 3}}
    assert (job.queue, job.priority, job.max_attempts, str(job.state)) == (
        "default",
        0,
        2,
        "available",
    )
    read = backend.get_result(result.id)
    assert read.status == TaskResultStatus.READY
    assert (read.args, read.kwargs, read.worker_ids, read.errors) == ([2], {"b": 3}, [], [])
    assert read.task.func is tasks.add.func
    assert read.started_at is None and read.finished_at is None


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_atomic_block_takes_its_job_with_it(backend: SkiplockBackend) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Ran.objects.create(label="order 1")
        rolled_back = tasks.record.enqueue("receipt 1")
        raise RuntimeError("payment failed")
    with transaction.atomic():
        Ran.objects.create(label="order 2")
        committed = tasks.record.enqueue("receipt 2")

    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result(rolled_back.id)
    assert backend.get_result(committed.id).status == TaskResultStatus.READY
    assert list(Ran.objects.values_list("label", flat=True)) == ["order 2"]


@pytest.mark.django_db(transaction=True)
def test_outside_atomic_the_job_commits_at_once(backend: SkiplockBackend) -> None:
    result = tasks.add.enqueue(1)

    assert connection.get_autocommit()
    with connection.cursor() as cursor:  # another statement, another transaction
        cursor.execute("SELECT count(*) FROM skiplock.jobs WHERE id = %s", [int(result.id)])
        assert cursor.fetchone() == (1,)


@pytest.mark.django_db(transaction=True)
def test_a_failed_insert_leaves_the_callers_transaction_usable() -> None:
    broken = {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "OPTIONS": {"SCHEMA": "no_such_schema"},
        }
    }
    with transaction.atomic():
        Ran.objects.create(label="before")
        with override_settings(TASKS=broken), pytest.raises(SchemaNotReadyError) as failed:
            tasks.add.enqueue(1)
        Ran.objects.create(label="after")  # the transaction was not aborted

    assert "run `python manage.py migrate`" in str(failed.value)
    assert sorted(Ran.objects.values_list("label", flat=True)) == ["after", "before"]


def test_queue_priority_and_run_after_are_the_jobs(backend: SkiplockBackend) -> None:
    later = timezone.now() + dt.timedelta(hours=1)
    email = tasks.send_email.using(priority=50, run_after=later).enqueue("ann@example.com")
    low = tasks.add.using(priority=-100).enqueue(1)
    default_urgent = tasks.urgent.enqueue("x")

    job = raw_job(email.id)
    assert (job.queue, job.priority, str(job.state), job.run_at) == (
        "emails",
        -50,
        "scheduled",
        later,
    )
    assert raw_job(low.id).priority == 100
    assert raw_job(default_urgent.id).priority == -10
    read = backend.get_result(email.id)
    assert (read.task.queue_name, read.task.priority, read.task.run_after) == (
        "emails",
        50,
        later,
    )


def test_without_use_tz_a_naive_run_after_is_in_the_default_time_zone() -> None:
    with override_settings(USE_TZ=False, TIME_ZONE="Europe/Paris"):
        naive = dt.datetime(2030, 7, 1, 12, 0)
        result = tasks.add.using(run_after=naive).enqueue(1)
    job = raw_job(result.id)
    assert job.run_at == dt.datetime(2030, 7, 1, 10, 0, tzinfo=dt.UTC)


@pytest.mark.django_db(transaction=True)
def test_aenqueue(backend: SkiplockBackend) -> None:
    async def enqueue() -> str:
        result = await tasks.async_add.aenqueue(2, 3)
        read = await backend.aget_result(result.id)
        assert read.status == TaskResultStatus.READY
        return str(result.id)

    job_id = asyncio.run(enqueue())
    assert backend.get_result(job_id).args == [2, 3]


# -- bad input: the framework's errors, at enqueue -----------------------------------------


def test_a_task_not_at_module_level_is_refused() -> None:
    from skiplock.contrib.django.compat import FRAMEWORK  # noqa: PLC0415

    task = __import__(FRAMEWORK, fromlist=["task"]).task

    with pytest.raises(InvalidTask, match="module level"):

        @task
        def inner() -> None: ...


@pytest.mark.parametrize("priority", [101, -101])
def test_a_priority_outside_the_frameworks_range_is_refused(priority: int) -> None:
    with pytest.raises(InvalidTask, match="priority"):
        tasks.add.using(priority=priority).enqueue(1)


def test_a_naive_run_after_with_use_tz_is_refused() -> None:
    with pytest.raises(InvalidTask, match="aware"):
        tasks.add.using(run_after=dt.datetime(2030, 1, 1)).enqueue(1)


def test_a_queue_not_in_queues_is_refused() -> None:
    with pytest.raises(InvalidTask, match="Queue 'reports' is not valid"):
        tasks.add.using(queue_name="reports").enqueue(1)


def test_a_queue_skiplock_cannot_store_is_refused() -> None:
    anything = {"default": {"BACKEND": "skiplock.contrib.django.SkiplockBackend", "QUEUES": []}}
    with override_settings(TASKS=anything), pytest.raises(InvalidTask, match="queue name"):
        tasks.add.using(queue_name="two words").enqueue(1)


def test_arguments_json_cannot_hold_are_refused_naming_the_argument() -> None:
    with pytest.raises(EnqueueError, match="argument 'a'"):
        tasks.add.enqueue(dt.datetime(2030, 1, 1))
    with pytest.raises(EnqueueError, match="argument 'b'"):
        tasks.add.enqueue(1, b=float("nan"))
    with pytest.raises(EnqueueError, match="argument 'subject'"):
        tasks.send_email.enqueue("ann@example.com", subject={1, 2})


def test_arguments_that_do_not_fit_the_function_are_refused() -> None:
    with pytest.raises(EnqueueError, match="missing a required argument: 'a'"):
        tasks.add.enqueue()
    with pytest.raises(EnqueueError, match="unexpected keyword argument 'c'"):
        tasks.add.enqueue(1, c=2)
    # takes_context: the context is the worker's to pass, not the caller's.
    with pytest.raises(EnqueueError, match="too many positional arguments"):
        tasks.introspect.enqueue(1, 2)


def test_a_database_that_is_not_postgresql_is_refused_naming_the_setting() -> None:
    lite = {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "OPTIONS": {"DATABASE": "lite"},
        }
    }
    with override_settings(TASKS=lite), pytest.raises(ImproperlyConfigured) as refused:
        tasks.add.enqueue(1)
    message = str(refused.value)
    assert "DATABASES['lite']['ENGINE']" in message
    assert "TASKS['default']['OPTIONS']['DATABASE']" in message


def test_an_unknown_option_is_refused_with_a_suggestion() -> None:
    typo = {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "OPTIONS": {"MAX_ATTEMPT": 5},
        }
    }
    with override_settings(TASKS=typo), pytest.raises(ImproperlyConfigured, match="MAX_ATTEMPTS"):
        task_backends["default"]


def test_json_of_the_stored_call_is_what_the_result_gives_back(backend: SkiplockBackend) -> None:
    args = [[1, 2], {"nested": [True, None, 1.5]}]
    result = tasks.add.enqueue(*args)
    assert raw_job(result.id).args == {"args": json.loads(json.dumps(args)), "kwargs": {}}
    assert backend.get_result(result.id).args == args
