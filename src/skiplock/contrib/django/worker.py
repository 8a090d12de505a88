"""Running Django tasks in a skiplock worker.

``DjangoTasksApp`` is the App a worker runs them with: instead of a registry filled by
``@app.task``, it finds each job's task by its import path (the path Django's
``Task.module_path`` gives, which is what the backend stores as the job's task) the first
time a job names it. A path that does not import to a Django task fails that job with
UnknownTaskError saying why.

Each run calls the task's function with the stored positional and keyword arguments (and
a ``TaskContext`` first for ``takes_context`` tasks), sends the framework's
``task_started`` and ``task_finished`` signals, and closes Django connections that are too
old or broken before and after, as Django does around a request.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connections
from django.utils import timezone
from django.utils.module_loading import import_string
from psycopg.conninfo import make_conninfo
from psycopg.pq import Conninfo

from skiplock.app import App
from skiplock.context import current_job
from skiplock.contrib.django.backend import SkiplockBackend, django_time
from skiplock.contrib.django.compat import (
    DjangoTask,
    DjangoTaskResult,
    InvalidTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    task_finished,
    task_started,
)
from skiplock.contrib.django.mapping import to_django_priority
from skiplock.errors import ConfigurationError, UnknownTaskError
from skiplock.tasks import MAX_QUEUE_NAME, TaskOptions, check_name
from skiplock.tasks import Task as SkiplockTask
from skiplock.types import ClaimedJob

_LIBPQ_KEYWORDS = frozenset(d.keyword.decode() for d in Conninfo.get_defaults())


def database_conninfo(alias: str) -> str:
    """A libpq connection string for a DATABASES alias: what Django itself would connect
    with (name, user, password, host, port, and OPTIONS that libpq knows), for the
    worker's own connections."""
    params = connections[alias].get_connection_params()
    kept = {
        key: value
        for key, value in params.items()
        if key in _LIBPQ_KEYWORDS and isinstance(value, (str, int)) and value != ""
    }
    return make_conninfo("", **kept)


def import_task(path: str) -> DjangoTask:
    """The Django task at ``path``, or UnknownTaskError saying why there is none."""
    try:
        found = import_string(path)
    except Exception as exc:  # an import error, or anything the module raises
        raise UnknownTaskError(
            f"no Django task {path!r}: importing it failed ({type(exc).__name__}: {exc}); "
            "is the module on the worker's path, and the task defined at module level?"
        ) from exc
    if not isinstance(found, Task):
        raise UnknownTaskError(
            f"{path!r} is not a Django task (got {type(found).__name__}); decorate the "
            "function with @task"
        )
    return found


class DjangoTasksApp(App):
    """The App a worker runs Django tasks with, on the backend's database and schema.

    ``worker_id`` is the worker's id (``manage.py skiplock_worker`` sets it): the live
    ``TaskResult`` of a first attempt is then built without a query.
    """

    def __init__(self, backend: SkiplockBackend) -> None:
        super().__init__(database_conninfo(backend.database), schema=backend.schema)
        self.backend = backend
        self.worker_id: str | None = None

    def get_task(self, name: str) -> SkiplockTask[Any]:
        registered = self.tasks.get(name)
        if registered is None:
            django_task = import_task(name)
            queue = django_task.queue_name
            try:
                check_name("queue", queue, MAX_QUEUE_NAME)
            except ConfigurationError:
                queue = "default"  # only for show: the job's own queue is what counts
            options = TaskOptions(
                queue=queue, max_attempts=self.backend.max_attempts, retry=self.backend.retry
            )
            registered = SkiplockTask(self, _runner(self, django_task), name, options)
            # Cached where the worker looks tasks up (cancelling an async one, say).
            self.tasks[name] = registered
        return registered

    def live_result(
        self, task: DjangoTask, job: ClaimedJob, call: tuple[list[Any], dict[str, Any]]
    ) -> DjangoTaskResult:
        """The TaskResult of the attempt now starting. A first attempt on a worker whose
        id is known is built from the claimed job; a later one is read (its earlier
        attempts' errors and workers are in the row)."""
        if self.needs_read(job):
            return self.backend.get_result(str(job.id))
        now = timezone.now()
        # Unless the job's queue is not among the task's backend's QUEUES.
        with contextlib.suppress(InvalidTask):
            task = task.using(queue_name=job.queue, priority=to_django_priority(job.priority))
        return TaskResult(
            task=task,
            id=str(job.id),
            status=TaskResultStatus.RUNNING,
            enqueued_at=django_time(job.created_at),
            started_at=now,
            finished_at=None,
            last_attempted_at=now,
            args=call[0],
            kwargs=call[1],
            backend=self.backend.alias,
            errors=[],
            worker_ids=[self.worker_id],
        )

    def needs_read(self, job: ClaimedJob) -> bool:
        """Whether ``live_result`` queries (an async runner then calls it in a thread)."""
        return job.attempts > 1 or self.worker_id is None


def _finished(result: DjangoTaskResult, failure: BaseException | None, value: Any) -> None:
    """Record the attempt's end on the live TaskResult, for the task_finished signal."""
    object.__setattr__(result, "finished_at", timezone.now())
    if failure is None:
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", value)
        return
    kind = type(failure)
    result.errors.append(
        TaskError(
            exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
            traceback="".join(traceback.format_exception(kind, failure, failure.__traceback__)),
        )
    )
    object.__setattr__(result, "status", TaskResultStatus.FAILED)


def _runner(app: DjangoTasksApp, task: DjangoTask) -> Callable[..., Any]:
    """The handler a skiplock Task runs for ``task``: called with the stored arguments,
    ``args`` and ``kwargs``."""
    sender = type(app.backend)
    if inspect.iscoroutinefunction(task.func):

        async def run_async(args: list[Any], kwargs: dict[str, Any]) -> Any:
            job = current_job()
            await sync_to_async(close_old_connections)()
            if app.needs_read(job):
                result = await sync_to_async(app.live_result)(task, job, (args, kwargs))
            else:
                result = app.live_result(task, job, (args, kwargs))
            task_started.send(sender, task_result=result)
            first = (TaskContext(task_result=result),) if task.takes_context else ()
            try:
                value = await task.func(*first, *args, **kwargs)
            except BaseException as failure:
                _finished(result, failure, None)
                task_finished.send(sender, task_result=result)
                raise
            finally:
                await sync_to_async(close_old_connections)()
            _finished(result, None, value)
            task_finished.send(sender, task_result=result)
            return value

        return run_async

    def run(args: list[Any], kwargs: dict[str, Any]) -> Any:
        job = current_job()
        close_old_connections()
        try:
            result = app.live_result(task, job, (args, kwargs))
            task_started.send(sender, task_result=result)
            first = (TaskContext(task_result=result),) if task.takes_context else ()
            try:
                value = task.func(*first, *args, **kwargs)
            except BaseException as failure:
                _finished(result, failure, None)
                task_finished.send(sender, task_result=result)
                raise
            _finished(result, None, value)
            task_finished.send(sender, task_result=result)
            return value
        finally:
            close_old_connections()

    return run
