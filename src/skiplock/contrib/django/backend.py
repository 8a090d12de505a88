"""``SkiplockBackend``: Django's Tasks framework on skiplock's tables.

A task is enqueued through Django's own connection for the configured database, so it is
part of whatever transaction the caller has open: a rollback takes the job with it, a
commit makes it visible to workers. No ``transaction.on_commit`` is needed.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from skiplock import client
from skiplock.config import DEFAULT_SCHEMA, SCHEMA_ENV, validate_schema
from skiplock.contrib.django.compat import (
    BaseTaskBackend,
    DjangoTask,
    DjangoTaskResult,
    InvalidTask,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
)
from skiplock.contrib.django.mapping import (
    StoredCall,
    error_text,
    exception_path,
    failed_at,
    status_name,
    to_django_priority,
    to_skiplock_priority,
)
from skiplock.contrib.django.sql import JOB_RESULT_GET
from skiplock.errors import ConfigurationError, EnqueueError, SchemaNotReadyError
from skiplock.migrate import pending_migrations
from skiplock.retry import RetryPolicy
from skiplock.sql import render
from skiplock.tasks import (
    MAX_QUEUE_NAME,
    MAX_TASK_NAME,
    JobSpec,
    TaskOptions,
    check_name,
    encode_args,
)

_OPTIONS = ("DATABASE", "SCHEMA", "MAX_ATTEMPTS", "RETRY")


@dataclass(frozen=True)
class BackendOptions:
    """A backend's OPTIONS, checked: the database alias, skiplock's schema in it, and
    what a failed attempt leads to (skiplock's defaults: 3 attempts, exponential
    back-off)."""

    database: str = "default"
    schema: str = DEFAULT_SCHEMA
    max_attempts: int = TaskOptions.max_attempts
    retry: RetryPolicy = field(default_factory=RetryPolicy)


def parse_options(alias: str, options: Mapping[str, Any]) -> BackendOptions:
    """Raise ImproperlyConfigured naming the setting when an option is wrong."""
    where = f"TASKS[{alias!r}]['OPTIONS']"
    for key in options:
        if key not in _OPTIONS:
            close = difflib.get_close_matches(key, _OPTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(_OPTIONS)})"
            raise ImproperlyConfigured(f"{where}: unknown option {key!r}{hint}")
    database = options.get("DATABASE", "default")
    if not isinstance(database, str) or not database:
        raise ImproperlyConfigured(f"{where}['DATABASE'] must name a DATABASES alias")
    schema = options.get("SCHEMA") or os.environ.get(SCHEMA_ENV) or DEFAULT_SCHEMA
    max_attempts = options.get("MAX_ATTEMPTS", TaskOptions.max_attempts)
    retry = options.get("RETRY", RetryPolicy())
    try:
        validate_schema(schema)
    except ConfigurationError as exc:
        raise ImproperlyConfigured(f"{where}['SCHEMA']: {exc}") from None
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise ImproperlyConfigured(
            f"{where}['MAX_ATTEMPTS'] must be an integer >= 1, got {max_attempts!r}"
        )
    if not isinstance(retry, RetryPolicy):
        raise ImproperlyConfigured(
            f"{where}['RETRY'] must be a skiplock.RetryPolicy, got {retry!r}"
        )
    return BackendOptions(database, schema, max_attempts, retry)


def encode_call(task: DjangoTask, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The job's arguments as JSON text, or EnqueueError naming the argument that does not
    fit the function or that JSON cannot hold."""
    path = task.module_path
    signature = inspect.signature(task.func)
    if task.takes_context:  # the worker passes the context first
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise EnqueueError(f"cannot enqueue {path}: {exc}") from None
    try:
        return encode_args(path, StoredCall(list(args), dict(kwargs)).to_json_object())
    except EnqueueError:
        # Said again by parameter name: "argument 'when'", not "argument 'args'[0]".
        encode_args(path, bound.arguments)
        raise


def _aware(value: datetime) -> datetime:
    """A run_after as an aware time: a naive one (allowed only without USE_TZ) is in
    Django's default time zone, as Django reads naive times."""
    return timezone.make_aware(value) if timezone.is_naive(value) else value


def django_time(value: datetime | None) -> datetime | None:
    """A time read outside Django's connection, as Django's settings want it."""
    if value is None:
        return None
    if timezone.is_aware(value) and not _use_tz():
        naive: datetime = timezone.make_naive(value)
        return naive
    return value


def _schema_migration_applied(connection: Any) -> bool:
    """Whether this app's Django migration (which installs skiplock's schema) is recorded
    as applied in the database of ``connection``."""
    from django.db.migrations.recorder import MigrationRecorder  # noqa: PLC0415

    return ("skiplock", "0001_skiplock_schema") in MigrationRecorder(
        connection
    ).applied_migrations()


def _use_tz() -> bool:
    from django.conf import settings  # noqa: PLC0415 - settings are read when used

    return bool(settings.USE_TZ)


class SkiplockBackend(BaseTaskBackend):
    """Runs Django tasks on skiplock. ``OPTIONS``: ``DATABASE`` (the DATABASES alias whose
    connection enqueues, default ``"default"``), ``SCHEMA`` (skiplock's schema there,
    default ``skiplock``), ``MAX_ATTEMPTS`` (default 3) and ``RETRY`` (a
    ``skiplock.RetryPolicy``)."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        parsed = parse_options(alias, self.options)
        self.database = parsed.database
        self.schema = parsed.schema
        self.max_attempts = parsed.max_attempts
        self.retry = parsed.retry

    # -- enqueue -----------------------------------------------------------------------

    def validate_task(self, task: DjangoTask) -> None:
        """The framework's checks, and skiplock's rules for names stored with the job."""
        super().validate_task(task)
        try:
            check_name("queue", task.queue_name, MAX_QUEUE_NAME)
        except ConfigurationError as exc:
            raise InvalidTask(str(exc)) from None
        if len(task.module_path) > MAX_TASK_NAME:
            raise InvalidTask(
                f"the task's import path is {len(task.module_path)} characters; skiplock "
                f"stores at most {MAX_TASK_NAME}"
            )

    def job_spec(self, task: DjangoTask, args: Sequence[Any], kwargs: Mapping[str, Any]) -> JobSpec:
        """The job a task call becomes; validates everything before anything is written."""
        self.validate_task(task)
        return JobSpec(
            task=task.module_path,
            args_json=encode_call(task, args, kwargs),
            queue=task.queue_name,
            priority=to_skiplock_priority(task.priority),
            max_attempts=self.max_attempts,
            run_at=None if task.run_after is None else _aware(task.run_after),
        )

    def enqueue(
        self, task: DjangoTask, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> DjangoTaskResult:
        """Insert the job in the current transaction of the configured database. Inside
        ``transaction.atomic()`` the insert runs in a savepoint of its own, so a failed
        insert (a missing schema, say) leaves the caller's transaction usable."""
        spec = self.job_spec(task, args, kwargs)
        with self.writing() as conn:
            job_id, _ = client.insert_job(conn, self.schema, spec)
        result = TaskResult(
            task=task,
            id=str(job_id),
            status=TaskResultStatus.READY,
            enqueued_at=timezone.now(),
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=list(args),
            kwargs=dict(kwargs),
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        task_enqueued.send(type(self), task_result=result)
        return result

    @contextlib.contextmanager
    def writing(self) -> Iterator[Any]:
        """The psycopg connection of the configured database's current transaction. Inside
        ``transaction.atomic()`` the block runs in a savepoint of its own; a missing schema
        is said with the command that installs it."""
        connection = self.connection()
        connection.ensure_connection()
        try:
            if connection.in_atomic_block or not connection.get_autocommit():
                # Django's own check: a transaction already broken is not written to.
                connection.validate_no_broken_transaction()
                with transaction.atomic(using=self.database):
                    yield connection.connection
            else:
                yield connection.connection
        except SchemaNotReadyError as exc:  # the client's, which names the CLI's command
            raise SchemaNotReadyError(
                f"skiplock's schema {self.schema!r} is not set up in database "
                f"{self.database!r} ({str(exc.__cause__).strip()}); run `python manage.py migrate`"
            ) from exc.__cause__

    # -- results -----------------------------------------------------------------------

    def get_result(self, result_id: str) -> DjangoTaskResult:
        """The job as a TaskResult, from the live table or history. TaskResultDoesNotExist
        when there is no such job (never enqueued, or pruned from history)."""
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(f"no task result {result_id!r}") from None
        connection = self.connection()
        with connection.cursor() as cursor:
            cursor.execute(render(JOB_RESULT_GET, self.schema), {"id": job_id})
            row = cursor.fetchone()
        if row is None:
            raise TaskResultDoesNotExist(
                f"no task result {result_id!r}: never enqueued, or pruned from history"
            )
        return self.result_from_row(row)

    def result_from_row(self, row: Sequence[Any]) -> DjangoTaskResult:
        job_id, queue, path, args_text, state, priority, run_at, _attempts = row[:8]
        errors_text, worker_ids, created_at, started_at, attempted_at = row[8:13]
        finished_at, result_text = row[13:]
        task = self._stored_task(int(job_id), path, queue, priority, run_at, created_at)
        call = StoredCall.from_json_text(args_text)
        records = [e for e in json.loads(errors_text) if isinstance(e, dict)]
        status = TaskResultStatus(status_name(state))
        result = TaskResult(
            task=task,
            id=str(job_id),
            status=status,
            enqueued_at=created_at,
            started_at=started_at,
            finished_at=finished_at or django_time(failed_at(state, records)),
            last_attempted_at=attempted_at,
            args=call.args,
            kwargs=call.kwargs,
            backend=self.alias,
            errors=[
                TaskError(exception_class_path=exception_path(e), traceback=error_text(e))
                for e in records
            ],
            worker_ids=list(worker_ids or []),
        )
        if status == TaskResultStatus.SUCCESSFUL and result_text is not None:
            object.__setattr__(result, "_return_value", json.loads(result_text))
        return result

    def _stored_task(
        self,
        job_id: int,
        path: str,
        queue: str,
        priority: int,
        run_at: datetime | None,
        created_at: datetime,
    ) -> DjangoTask:
        """The task a job names, with the job's own queue, priority and run_after."""
        try:
            task = import_string(path)
        except ImportError as exc:
            raise TaskResultDoesNotExist(
                f"task result {job_id} is of {path!r}, which cannot be imported here: {exc}"
            ) from None
        if not isinstance(task, Task):
            raise TaskResultDoesNotExist(
                f"task result {job_id} is of {path!r}, which is not a Django task"
            )
        run_after = run_at if run_at is not None and run_at > created_at else None
        try:
            return task.using(
                queue_name=queue, priority=to_django_priority(priority), run_after=run_after
            )
        except InvalidTask:
            return task  # the job's queue is not among the task's backend's QUEUES

    # -- configuration -----------------------------------------------------------------

    def connection(self) -> Any:
        """Django's connection for the configured database (the current thread's),
        refused with the setting to change unless it is PostgreSQL through psycopg 3."""
        problem = self._database_problem()
        if problem is not None:
            raise ImproperlyConfigured(problem[1])
        return connections[self.database]

    def _database_problem(self) -> tuple[str, str] | None:
        """(check id, message) when the configured database cannot hold skiplock's jobs."""
        setting = f"TASKS[{self.alias!r}]['OPTIONS']['DATABASE']"
        if self.database not in connections:
            return "skiplock.E001", (
                f"{setting} is {self.database!r}, which is not in DATABASES: set it to a "
                "DATABASES alias"
            )
        connection = connections[self.database]
        if connection.vendor != "postgresql":
            return "skiplock.E002", (
                f"DATABASES[{self.database!r}] is {connection.vendor} "
                f"({connection.settings_dict.get('ENGINE')}); skiplock keeps its jobs in "
                f"PostgreSQL: set DATABASES[{self.database!r}]['ENGINE'] to "
                f"'django.db.backends.postgresql', or {setting} to a PostgreSQL database"
            )
        from django.db.backends.postgresql.psycopg_any import is_psycopg3  # noqa: PLC0415

        if not is_psycopg3:
            return "skiplock.E003", (
                f"DATABASES[{self.database!r}] connects through psycopg2; skiplock needs "
                "psycopg 3 (pip install 'psycopg[binary]'; Django uses it when installed)"
            )
        return None

    def check(self, **kwargs: Any) -> list[Any]:
        """System checks: the database is PostgreSQL through psycopg 3, every queue name
        is one skiplock can store, and (for ``check --database``, and before
        ``migrate``) skiplock's migrations are applied."""
        messages: list[Any] = list(super().check(**kwargs))
        problem = self._database_problem()
        if problem is not None:
            messages.append(checks.Error(problem[1], id=problem[0]))
        for queue in sorted(self.queues):
            try:
                check_name("queue", queue, MAX_QUEUE_NAME)
            except ConfigurationError as exc:
                messages.append(
                    checks.Error(
                        f"TASKS[{self.alias!r}]['QUEUES']: {exc}",
                        hint="use letters, digits and '_', '.', ':', '-'",
                        id="skiplock.E004",
                    )
                )
        from django.apps import apps  # noqa: PLC0415

        if not apps.is_installed("skiplock.contrib.django"):
            messages.append(
                checks.Warning(
                    "skiplock.contrib.django is not in INSTALLED_APPS",
                    hint="add it: `manage.py migrate` then installs skiplock's schema, and "
                    "`manage.py skiplock_worker` runs the tasks",
                    id="skiplock.W003",
                )
            )
        if problem is None:
            messages.extend(self.check_schema(kwargs.get("databases")))
        return messages

    def check_schema(self, databases: Sequence[str] | None) -> list[Any]:
        """A warning when skiplock's migrations are not all applied (a query: only for
        the databases a check names, as Django's database checks)."""
        if not databases or self.database not in databases:
            return []
        connection = connections[self.database]
        try:
            connection.ensure_connection()
            pending = pending_migrations(connection.connection, self.schema)
        except Exception as exc:
            return [
                checks.Warning(
                    f"could not read skiplock's migrations in database {self.database!r}: "
                    f"{str(exc).strip()}",
                    id="skiplock.W002",
                )
            ]
        if not pending or not _schema_migration_applied(connection):
            # Before the app's own migration, Django's "unapplied migrations" says it all
            # (and `migrate` itself would warn about what it is about to do).
            return []
        names = ", ".join(m.label for m in pending)
        return [
            checks.Warning(
                f"skiplock's schema {self.schema!r} in database {self.database!r} is missing "
                f"migrations: {names}",
                hint="run `python manage.py migrate` (workers refuse to start until then)",
                id="skiplock.W001",
            )
        ]
