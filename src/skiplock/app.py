"""The App: a task registry bound to one database and schema."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, TypeVar, overload

import psycopg

from skiplock import client, routing
from skiplock.batch import Batch
from skiplock.config import (
    DEFAULT_SCHEMA,
    EMBEDDED,
    SCHEMA_ENV,
    resolve_database_url,
    validate_schema,
)
from skiplock.cron import MISSED_POLICIES, parse_cron
from skiplock.durable import check_signal_key, signal_payload_json
from skiplock.errors import ConfigurationError, UnknownTaskError
from skiplock.migrate import Migration, check_schema_ready, migrate
from skiplock.periodic import Periodic
from skiplock.results import JobRef, wait_for_result, wait_for_result_async
from skiplock.tasks import MAX_TASK_NAME, JobSpec, Task, check_name, parse_task_options
from skiplock.tracing import Send, Tracing
from skiplock.wording import with_article
from skiplock.workflow import Workflow, register_app

R = TypeVar("R")

DEFAULT_SIGNAL_RETENTION = timedelta(days=7)


class App:
    """Tasks plus where their jobs live.

    ``database_url`` defaults to ``SKIPLOCK_DATABASE_URL``; with neither, using the database
    raises ConfigurationError. ``embedded=True`` (or the URL value "embedded") starts a
    throwaway local PostgreSQL instead (the ``embedded`` extra). Nothing connects, and
    nothing is checked, until something needs the database: the CLI configures an App
    after importing it.

    ``signal_retention`` is how long a signal sent before anyone waits for it is kept
    (``App.signal``).

    ``queue_databases`` is the routing table for queues spread over several databases:
    ``{"reports": "postgresql://HOST/reports"}`` puts queue "reports" there, and every
    queue it does not name lives on ``database_url``. Each database needs `skiplock
    migrate` and keeps its own leader, history and cron (docs/routing.md).
    """

    def __init__(
        self,
        database_url: str | None = None,
        *,
        schema: str | None = None,
        embedded: bool = False,
        queue_databases: Mapping[str, str] | None = None,
        signal_retention: timedelta = DEFAULT_SIGNAL_RETENTION,
    ) -> None:
        import os  # noqa: PLC0415

        if embedded and database_url and database_url != EMBEDDED:
            raise ConfigurationError("give App a database_url or embedded=True, not both")
        if database_url is not None:  # a typo fails here, not in psycopg at the first job
            routing.check_database_url(database_url, "App(database_url=...)")
        self.schema = validate_schema(schema or os.environ.get(SCHEMA_ENV) or DEFAULT_SCHEMA)
        self._database_url = database_url
        self._embedded = embedded
        self.tasks: dict[str, Task[Any]] = {}
        self.periodics: dict[str, Periodic] = {}
        # Spans for enqueues and attempts; None costs nothing (skiplock.contrib.otel).
        self.tracing: Tracing | None = None
        # Queue -> database URL for the queues that do not live on database_url.
        self.queue_databases = routing.check_routes(queue_databases)
        # Which database each URL reaches, learned once (routing.url_identity).
        self._identities: dict[str, routing.Identity] = {}
        self._bound: dict[str, App] = {}
        if not isinstance(signal_retention, timedelta) or signal_retention <= timedelta(0):
            raise ConfigurationError(
                f"signal_retention is a positive timedelta, got {signal_retention!r}"
            )
        # How long a signal nobody waits for yet is kept for a wait to come.
        self.signal_retention = signal_retention
        register_app(self)  # so that parent_results() finds the App of a running step

    def configure(self, *, database_url: str | None = None, schema: str | None = None) -> None:
        """Point an already-defined App elsewhere (the CLI's --database-url and --schema)."""
        if database_url:
            self._database_url = routing.check_database_url(database_url, "database_url")
            self._embedded = False
        if schema:
            self.schema = validate_schema(schema)

    @property
    def database_url(self) -> str:
        if self._database_url is None or self._database_url == EMBEDDED:
            self._database_url = resolve_database_url(self._database_url, embedded=self._embedded)
        return self._database_url

    @overload
    def task(self, fn: Callable[..., R], /) -> Task[R]: ...

    @overload
    def task(self, fn: None = None, /, **options: Any) -> Callable[[Callable[..., R]], Task[R]]: ...

    def task(
        self, fn: Callable[..., R] | None = None, /, **options: Any
    ) -> Task[R] | Callable[[Callable[..., R]], Task[R]]:
        """Register a handler. Options: name, queue, priority, max_attempts, retry,
        transactional, timeout. Unknown options fail here, not when a job runs."""
        name, parsed = parse_task_options(options)

        def register(func: Callable[..., R]) -> Task[R]:
            task_name = name or f"{func.__module__}.{func.__qualname__}"
            if name is None and "<" in task_name:
                raise ConfigurationError(
                    f"{func.__qualname__!r} is defined inside a function, so it has no stable "
                    "import name; pass one: @app.task(name='...')"
                )
            check_name("task", task_name, MAX_TASK_NAME)
            if task_name in self.tasks:
                raise ConfigurationError(f"task {task_name!r} is already registered")
            registered = Task(self, func, task_name, parsed)
            self.tasks[task_name] = registered
            return registered

        return register(fn) if fn is not None else register

    def periodic(
        self,
        cron: str,
        *,
        args: dict[str, Any] | None = None,
        timezone: str | None = None,
        missed: str = "latest",
        **options: Any,
    ) -> Callable[[Callable[..., R]], Task[R]]:
        """Register a handler and enqueue it on a cron schedule, once per tick across all
        workers (every worker of this App tries; decision 021). ``args`` are fixed
        arguments; ``missed`` says what to do with ticks missed while no worker ran:
        ``latest`` (enqueue the most recent), ``all`` (each, at most 100) or ``skip``.
        Other options are the task's. A bad expression fails here, at definition time."""
        schedule = parse_cron(cron, timezone)
        if missed not in MISSED_POLICIES:
            raise ConfigurationError(
                f"missed={missed!r}: choose one of {', '.join(MISSED_POLICIES)}"
            )
        fixed = dict(args or {})

        def register(func: Callable[..., R]) -> Task[R]:
            registered = self.task(**options)(func)
            try:
                registered.job(**fixed)  # the fixed arguments must fit the handler, now
            except Exception:
                del self.tasks[registered.name]  # nothing half-registered
                raise
            self.periodics[registered.name] = Periodic(registered, schedule, fixed, missed)
            return registered

        return register

    def workflow(self, name: str | None = None, *, run_anyway: bool = False) -> Workflow:
        """A new workflow of this App's tasks: add steps, then ``enqueue(conn)``
        (skiplock/workflow.py, docs/decisions/024)."""
        return Workflow(name, app=self, run_anyway=run_anyway)

    def batch(self, on_finish: JobSpec, *, name: str | None = None) -> Batch:
        """A new batch whose callback ``on_finish`` runs once it is closed and every job
        added has ended (skiplock/batch.py, docs/decisions/025). Written by its first
        ``add`` or ``close``."""
        self._check_batches()
        return Batch(self, on_finish, name=name)

    def batch_by_id(self, batch_id: int) -> Batch:
        """The batch written earlier as ``batch_id``, to add jobs to it or close it."""
        self._check_batches()
        if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 1:
            raise ConfigurationError(f"a batch id is a positive integer, got {batch_id!r}")
        return Batch(self, None, batch_id=batch_id)

    def _check_batches(self) -> None:
        if self.queue_databases:
            raise ConfigurationError(
                "batches are not supported yet on an App with queue_databases: build the "
                "batch on an App of the one database its jobs live on"
            )

    def get_task(self, name: str) -> Task[Any]:
        try:
            return self.tasks[name]
        except KeyError:
            hint = ""
            if name.startswith("__main__."):
                # Enqueued by a script run as `python script.py`: its tasks are named after
                # __main__, and the worker, which imports the module, knows them by its name.
                hint = (
                    ": it was enqueued by a script run directly, whose tasks are named "
                    "__main__.*; define the tasks in a module both import, or name them "
                    "(@app.task(name=...))"
                )
            raise UnknownTaskError(
                f"no task named {name!r} is registered in this app{hint}"
            ) from None

    def connect(self, *, queue: str | None = None, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new connection to the app's database, or to ``queue``'s (the caller closes it)."""
        url = self.database_url if queue is None else self.database_url_for(queue)
        return psycopg.connect(url, **kwargs)

    # -- queues over several databases (routing.py) -------------------------------------

    def database_url_for(self, queue: str) -> str:
        """The URL of the database ``queue`` lives on."""
        return self.queue_databases.get(queue) or self.database_url

    def databases(self) -> list[str]:
        """Every database of this App, ``database_url`` first."""
        return list(dict.fromkeys([self.database_url, *self.queue_databases.values()]))

    def queues_by_database(self, queues: Sequence[str]) -> dict[str, list[str]]:
        """Database URL -> the given queues that live there, ``database_url`` first."""
        return routing.group_queues(queues, self.database_url, self.queue_databases)

    def _for_database(self, url: str) -> App:
        """This App bound to one of its databases alone, for a worker or a command that
        serves that database: the same tasks (shared), schema and tracing, no routes,
        and the periodic tasks whose queue lives there (so each database's workers
        enqueue its own ticks)."""
        if url not in self.databases():
            raise ConfigurationError(f"{routing.describe_url(url)} is not a database of this App")
        bound = App(url, schema=self.schema, signal_retention=self.signal_retention)
        bound.tasks = self.tasks
        bound.tracing = self.tracing
        bound.periodics = {
            name: periodic
            for name, periodic in self.periodics.items()
            if self.database_url_for(periodic.task.options.queue) == url
        }
        return bound

    def _result_app(self, url: str) -> App:
        """Where a JobRef of a job on ``url`` waits for its result."""
        if not self.queue_databases or url == self.database_url:
            return self
        bound = self._bound.get(url)
        if bound is None:
            bound = self._bound[url] = self._for_database(url)
        return bound

    def _route(self, conn: psycopg.Connection[Any], queues: Sequence[str]) -> str:
        """The database these jobs go to, checked to be ``conn``'s (routes only)."""
        url = routing.single_database(queues, self.database_url, self.queue_databases)
        wanted = self._identities.get(url)
        if wanted is None:
            wanted = self._identities[url] = routing.url_identity(url)
        if routing.connection_identity(conn) != wanted:
            raise routing.wrong_database(queues[0], url, conn)
        return url

    async def _route_async(self, conn: psycopg.AsyncConnection[Any], queues: Sequence[str]) -> str:
        url = routing.single_database(queues, self.database_url, self.queue_databases)
        wanted = self._identities.get(url)
        if wanted is None:
            wanted = self._identities[url] = await routing.url_identity_async(url)
        if await routing.connection_identity_async(conn) != wanted:
            raise routing.wrong_database(queues[0], url, conn)
        return url

    def migrate(self, *, target: int | None = None) -> list[Migration]:
        """Apply pending schema migrations; safe to call from several processes at once."""
        with self.connect(autocommit=True) as conn:
            return migrate(conn, self.schema, target=target)

    def check_schema(self) -> None:
        with self.connect(autocommit=True) as conn:
            check_schema_ready(conn, self.schema)

    def enqueue_many(self, conn: psycopg.Connection[Any], jobs: Sequence[JobSpec]) -> list[int]:
        """Insert many jobs at COPY speed in ``conn``'s transaction. Returns their ids.
        With routes, every job must live on ``conn``'s database."""
        if self.queue_databases and jobs:
            self._route(conn, [spec.queue for spec in jobs])
        if self.tracing is None or not jobs:
            return client.insert_jobs(conn, self.schema, jobs)
        with _send(self.tracing, jobs) as send:
            ids = client.insert_jobs(conn, self.schema, jobs, meta=send.meta_json)
            send.sent(ids)
            return ids

    async def enqueue_many_async(
        self, conn: psycopg.AsyncConnection[Any], jobs: Sequence[JobSpec]
    ) -> list[int]:
        if self.queue_databases and jobs:
            await self._route_async(conn, [spec.queue for spec in jobs])
        if self.tracing is None or not jobs:
            return await client.insert_jobs_async(conn, self.schema, jobs)
        with _send(self.tracing, jobs) as send:
            ids = await client.insert_jobs_async(conn, self.schema, jobs, meta=send.meta_json)
            send.sent(ids)
            return ids

    def _enqueue_spec(self, conn: psycopg.Connection[Any], spec: JobSpec) -> JobRef:
        """Insert one validated job in ``conn``'s transaction (what ``Task.enqueue`` calls)."""
        owner = self
        if self.queue_databases:
            owner = self._result_app(self._route(conn, [spec.queue]))
        if self.tracing is None:
            job_id, inserted = client.insert_job(conn, self.schema, spec)
            return JobRef(job_id, owner, duplicate=not inserted)
        with self.tracing.send(spec.queue, spec.task, 1, batch=False) as send:
            job_id, inserted = client.insert_job(conn, self.schema, spec, meta=send.meta_json)
            send.sent([job_id], duplicate=not inserted)
        return JobRef(job_id, owner, duplicate=not inserted)

    async def _enqueue_spec_async(
        self, conn: psycopg.AsyncConnection[Any], spec: JobSpec
    ) -> JobRef:
        owner = self
        if self.queue_databases:
            owner = self._result_app(await self._route_async(conn, [spec.queue]))
        if self.tracing is None:
            job_id, inserted = await client.insert_job_async(conn, self.schema, spec)
            return JobRef(job_id, owner, duplicate=not inserted)
        with self.tracing.send(spec.queue, spec.task, 1, batch=False) as send:
            job_id, inserted = await client.insert_job_async(
                conn, self.schema, spec, meta=send.meta_json
            )
            send.sent([job_id], duplicate=not inserted)
        return JobRef(job_id, owner, duplicate=not inserted)

    def signal(self, conn: psycopg.Connection[Any], key: str, payload: Any = None) -> int | None:
        """Send the signal ``key`` with ``payload`` (JSON) in ``conn``'s transaction; it
        never commits, and a rollback sends nothing. The oldest job waiting for ``key``
        (``skiplock.wait_for``) resumes with ``payload``, and its id is returned; with none
        waiting, the signal is kept for the next wait, ``signal_retention`` at most, and
        None is returned."""
        key = check_signal_key(key)
        text = signal_payload_json(key, payload)
        return client.send_signal(
            conn, self.schema, key, text, kept_for=self.signal_retention.total_seconds()
        )

    async def signal_async(
        self, conn: psycopg.AsyncConnection[Any], key: str, payload: Any = None
    ) -> int | None:
        """``signal`` on an async connection."""
        key = check_signal_key(key)
        text = signal_payload_json(key, payload)
        return await client.send_signal_async(
            conn, self.schema, key, text, kept_for=self.signal_retention.total_seconds()
        )

    def result(self, job_id: int, timeout: float | None = None, *, queue: str | None = None) -> Any:
        """Wait for a job's result (JobFailedError if it ends dead or cancelled). With
        routes, ids are per database: ``queue`` says which (default: ``database_url``)."""
        where = self if queue is None else self._result_app(self.database_url_for(queue))
        return wait_for_result(where, job_id, timeout)

    async def result_async(
        self, job_id: int, timeout: float | None = None, *, queue: str | None = None
    ) -> Any:
        where = self if queue is None else self._result_app(self.database_url_for(queue))
        return await wait_for_result_async(where, job_id, timeout)


def load_app(spec: str) -> App:
    """The App at ``module:attribute`` (``--app``), imported with the current directory
    importable, as ``python -m`` does: what the CLI and the dashboard run."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"expected MODULE:APP (e.g. myapp.tasks:app), got {spec!r}")
    if "/" in module_name or module_name.endswith(".py"):
        dotted = module_name.removesuffix(".py").strip("/").replace("/", ".")
        raise ConfigurationError(
            f"{spec!r} names a file; name the module, with dots: {dotted}:{attribute}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    if not hasattr(module, attribute):
        apps = sorted(name for name, value in vars(module).items() if isinstance(value, App))
        near = difflib.get_close_matches(attribute, apps, n=1, cutoff=0.5)
        hint = (
            f"; did you mean {module_name}:{near[0]}?"
            if near
            else f"; its Apps: {', '.join(apps)}"
            if apps
            else "; it defines no skiplock.App"
        )
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}{hint}")
    app = getattr(module, attribute)
    if not isinstance(app, App):
        raise ConfigurationError(
            f"{spec!r} is {with_article(type(app).__name__)}, not a skiplock.App"
        )
    return app


def _send(tracing: Tracing, jobs: Sequence[JobSpec]) -> AbstractContextManager[Send]:
    """The send span of a bulk enqueue: its queue and task named when all jobs share them."""
    queues = {spec.queue for spec in jobs}
    tasks = {spec.task for spec in jobs}
    return tracing.send(
        queues.pop() if len(queues) == 1 else None,
        tasks.pop() if len(tasks) == 1 else None,
        len(jobs),
        batch=True,
    )
