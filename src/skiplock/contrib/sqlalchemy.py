"""Enqueue through a SQLAlchemy 2 ``Session`` or ``AsyncSession``, in its transaction.

The job is inserted through the psycopg 3 connection under the session's current
transaction, so it commits with ``session.commit()`` and vanishes with a rollback, or
with the rollback of a savepoint (``begin_nested``) it was enqueued in. Nothing here
commits or flushes. An engine on another driver is refused before anything runs, with the
URL to use instead (docs/sqlalchemy.md).

A Core ``Connection`` (or ``AsyncConnection``) works too, in place of a session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy.engine import URL, Connection, Dialect, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from skiplock import client
from skiplock.app import App
from skiplock.errors import ConfigurationError
from skiplock.results import JobRef
from skiplock.tasks import JobSpec, Task, TaskCall
from skiplock.types import Job
from skiplock.workflow import Workflow, WorkflowRef

__all__ = [
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "enqueue_workflow",
    "enqueue_workflow_async",
    "get_job",
    "get_job_async",
    "psycopg_connection",
    "psycopg_connection_async",
]

# What can be enqueued: a task, or a task with per-call options (task.with_options(...)).
Enqueueable = Task[Any] | TaskCall[Any]


def _check_dialect(dialect: Dialect, url: URL | None) -> None:
    """Refuse an engine that is not PostgreSQL through psycopg 3, naming the URL to use."""
    if dialect.name == "postgresql" and dialect.driver == "psycopg":
        return
    where = f"the engine's URL is {url.drivername}://..." if url is not None else ""
    if dialect.name != "postgresql":
        raise ConfigurationError(
            f"skiplock needs PostgreSQL, and {where or 'this engine'} ({dialect.name}): "
            "create the engine with a 'postgresql+psycopg://' URL"
        )
    raise ConfigurationError(
        f"skiplock.contrib.sqlalchemy enqueues through the psycopg 3 driver, but "
        f"{where or 'this engine uses ' + dialect.driver}: create the engine "
        "(create_engine or create_async_engine) with a 'postgresql+psycopg://' URL "
        "(pip install 'psycopg[binary]'; the same URL serves sync and async engines)"
    )


def _bind_of(target: Session | Connection) -> Engine | Connection:
    bind = target.get_bind() if isinstance(target, Session) else target
    if not isinstance(bind, (Engine, Connection)):
        raise TypeError(f"expected an Engine or Connection bind, got {type(bind).__name__}")
    return bind


def psycopg_connection(target: Session | Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``target``'s current transaction, begun if none is.

    Use it to call skiplock's other functions (``app.enqueue_many``, the admin ones) in
    the session's transaction; never commit or roll it back directly."""
    if isinstance(target, AsyncSession | AsyncConnection):
        raise TypeError("an async session or connection: use the *_async functions")
    if not isinstance(target, Session | Connection):
        raise TypeError(f"expected a sqlalchemy Session or Connection, got {type(target).__name__}")
    bind = _bind_of(target)
    _check_dialect(bind.dialect, bind.engine.url)
    if isinstance(target, Session):
        connection = target.connection()  # begins the session's transaction if need be
    else:
        connection = target
        if not connection.in_transaction():
            # What SQLAlchemy's autobegin would do for a statement of its own: without
            # it, conn.commit() would have no transaction to commit, and the job would
            # be lost when the connection goes back to the pool.
            connection.begin()
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise ConfigurationError(
            f"expected a psycopg.Connection under the session, got {type(driver).__name__}"
        )
    return driver


async def psycopg_connection_async(
    target: AsyncSession | AsyncConnection,
) -> psycopg.AsyncConnection[Any]:
    """Async twin of ``psycopg_connection``, for an ``AsyncSession`` or ``AsyncConnection``."""
    if isinstance(target, Session | Connection):
        raise TypeError("a sync session or connection: use the functions without _async")
    if not isinstance(target, AsyncSession | AsyncConnection):
        raise TypeError(
            f"expected a sqlalchemy AsyncSession or AsyncConnection, got {type(target).__name__}"
        )
    if isinstance(target, AsyncSession):
        bind = _bind_of(target.sync_session)
        _check_dialect(bind.dialect, bind.engine.url)
        connection = await target.connection()
    else:
        _check_dialect(target.dialect, target.engine.url)
        connection = target
        if not connection.in_transaction():
            await connection.begin()  # as in psycopg_connection
    raw = await connection.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):
        raise ConfigurationError(
            "expected a psycopg.AsyncConnection under the session, got "
            f"{type(driver).__name__}: create the engine with create_async_engine"
        )
    return driver


def _app_of(task: Enqueueable) -> App:
    if isinstance(task, Task):
        return task.app
    if isinstance(task, TaskCall):
        return task.task.app
    raise TypeError(
        f"expected a skiplock task (or task.with_options(...)), got {type(task).__name__}"
    )


def enqueue(session: Session | Connection, task: Enqueueable, /, **args: Any) -> JobRef:
    """Insert a job of ``task`` in the session's current transaction; never commits.

    ``task`` may carry per-call options: ``enqueue(session, task.with_options(delay=60),
    order_id=1)``. Returns the job's id (a ``JobRef``). The arguments are checked before
    anything is sent: ``EnqueueError`` names the one that does not fit."""
    spec = task.job(**args)
    app = _app_of(task)
    return app._enqueue_spec(psycopg_connection(session), spec)


async def enqueue_async(
    session: AsyncSession | AsyncConnection, task: Enqueueable, /, **args: Any
) -> JobRef:
    """Async twin of ``enqueue``, for an ``AsyncSession``."""
    spec = task.job(**args)
    app = _app_of(task)
    return await app._enqueue_spec_async(await psycopg_connection_async(session), spec)


def enqueue_many(
    session: Session | Connection, jobs: Sequence[JobSpec], /, *, app: App
) -> list[int]:
    """Insert many jobs (``task.job(...)`` each) at COPY speed in the session's current
    transaction; never commits. ``app`` says which schema they go to. Returns their ids."""
    if not jobs:
        return []
    return app.enqueue_many(psycopg_connection(session), jobs)


async def enqueue_many_async(
    session: AsyncSession | AsyncConnection, jobs: Sequence[JobSpec], /, *, app: App
) -> list[int]:
    """Async twin of ``enqueue_many``."""
    if not jobs:
        return []
    return await app.enqueue_many_async(await psycopg_connection_async(session), jobs)


def enqueue_workflow(session: Session | Connection, workflow: Workflow, /) -> WorkflowRef:
    """Insert every step of ``workflow`` in the session's current transaction, in one
    statement; never commits. A rollback (of the session, or of the savepoint it was
    enqueued in) takes the whole workflow with it."""
    return workflow.enqueue(psycopg_connection(session))


async def enqueue_workflow_async(
    session: AsyncSession | AsyncConnection, workflow: Workflow, /
) -> WorkflowRef:
    """Async twin of ``enqueue_workflow``."""
    return await workflow.enqueue_async(await psycopg_connection_async(session))


def get_job(session: Session | Connection, job_id: int, /, *, app: App) -> Job:
    """A job as the session's transaction sees it, waiting or finished (its ``state``,
    ``result``, ``errors``); raises ``JobNotFoundError`` for an unknown or pruned id."""
    return client.get_job(psycopg_connection(session), app.schema, job_id)


async def get_job_async(
    session: AsyncSession | AsyncConnection, job_id: int, /, *, app: App
) -> Job:
    """Async twin of ``get_job``."""
    return await client.get_job_async(await psycopg_connection_async(session), app.schema, job_id)
