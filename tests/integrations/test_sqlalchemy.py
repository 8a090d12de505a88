"""skiplock.contrib.sqlalchemy: jobs enqueued through a Session or AsyncSession commit
and roll back with it (savepoints included), in bulk too; other drivers are refused."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Engine, String, create_engine, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import skiplock
from skiplock.contrib.sqlalchemy import (
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
    enqueue_workflow,
    enqueue_workflow_async,
    get_job,
    get_job_async,
    psycopg_connection,
    psycopg_connection_async,
)
from skiplock.testing import enqueued_jobs

SCHEMA = "skiplock"  # the suite's own (tests/conftest.py)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sa_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(50))


@pytest.fixture(scope="module")
def tasks(database_url: str) -> skiplock.App:
    """An App on the suite's schema with one task."""
    made = skiplock.App(database_url, schema=SCHEMA)

    @made.task(name="sa.send_receipt", queue="emails")
    def send_receipt(order_id: int) -> None: ...

    return made


@pytest.fixture
def app(tasks: skiplock.App) -> Iterator[skiplock.App]:
    """``tasks`` with no job before or after the test (the tests here commit; they write
    jobs and nothing else, so emptying that table is enough, and quicker)."""
    with tasks.connect(autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(SCHEMA, "jobs")))
        yield tasks
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(SCHEMA, "jobs")))


def receipt(app: skiplock.App) -> skiplock.Task[Any]:
    return app.get_task("sa.send_receipt")


def committed(app: skiplock.App) -> list[int]:
    """The order ids of the receipts other sessions see (the committed ones)."""
    with app.connect() as conn:
        return [job.args["order_id"] for job in enqueued_jobs(conn, app)]


@pytest.fixture(scope="module")
def engine(database_url: str) -> Iterator[Engine]:
    made = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(database_url))
    Base.metadata.create_all(made)
    yield made
    Base.metadata.drop_all(made)
    made.dispose()


def async_engine(database_url: str) -> AsyncEngine:
    async def connect() -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(database_url)

    return create_async_engine("postgresql+psycopg://", async_creator=connect)


# -- Session ---------------------------------------------------------------------------


def test_a_commit_keeps_the_order_and_its_job(engine: Engine, app: skiplock.App) -> None:
    with Session(engine) as session:
        session.add(Order(id=1, item="lamp"))
        session.flush()
        ref = enqueue(session, receipt(app), order_id=1)
        assert committed(app) == []
        session.commit()

    assert isinstance(ref, skiplock.JobRef)
    assert committed(app) == [1]
    with Session(engine) as session:
        assert session.scalars(select(Order.item).where(Order.id == 1)).all() == ["lamp"]


def test_a_rollback_takes_the_job_with_it(engine: Engine, app: skiplock.App) -> None:
    with Session(engine) as session:
        session.add(Order(id=1, item="lamp"))
        enqueue(session, receipt(app), order_id=1)
        session.rollback()
        enqueue(session, receipt(app), order_id=2)  # the session's next transaction
        session.commit()

    assert committed(app) == [2]


def test_savepoints_keep_or_drop_their_jobs(engine: Engine, app: skiplock.App) -> None:
    with Session(engine) as session:
        enqueue(session, receipt(app), order_id=1)
        with session.begin_nested() as kept:
            enqueue(session, receipt(app), order_id=2)
            kept.commit()
        dropped = session.begin_nested()
        enqueue(session, receipt(app), order_id=3)
        dropped.rollback()
        session.commit()

    assert committed(app) == [1, 2]


def test_options_and_reading_the_job_back(engine: Engine, app: skiplock.App) -> None:
    with Session(engine) as session:
        ref = enqueue(session, receipt(app).with_options(delay=60, queue="later"), order_id=1)
        job = get_job(session, ref, app=app)  # the session sees its own uncommitted job
        session.commit()

    assert (job.state, job.queue) == (skiplock.JobState.SCHEDULED, "later")


def test_enqueue_many_copies_in_the_sessions_transaction(engine: Engine, app: skiplock.App) -> None:
    jobs = [receipt(app).job(order_id=i) for i in range(500)]
    with Session(engine) as session:
        enqueue_many(session, jobs, app=app)
        session.rollback()
        ids = enqueue_many(session, jobs, app=app)
        assert enqueue_many(session, [], app=app) == []
        session.commit()

    assert len(ids) == 500
    assert committed(app) == list(range(500))


def test_a_core_connection_commits_what_it_enqueued(engine: Engine, app: skiplock.App) -> None:
    with engine.connect() as conn:
        enqueue(conn, receipt(app), order_id=1)
        conn.commit()
        enqueue(conn, receipt(app), order_id=2)  # closed without a commit: rolled back

    assert committed(app) == [1]


def test_the_driver_connection_is_the_sessions(engine: Engine, app: skiplock.App) -> None:
    with Session(engine) as session:
        session.add(Order(id=7, item="desk"))
        session.flush()
        raw = psycopg_connection(session)
        row = raw.execute("SELECT item FROM sa_orders WHERE id = 7").fetchone()
        session.rollback()

    assert row == ("desk",)


def test_bad_arguments_send_nothing(engine: Engine, app: skiplock.App) -> None:
    with Session(engine) as session:
        session.add(Order(id=2, item="lamp"))
        with pytest.raises(skiplock.EnqueueError, match="order_id"):
            enqueue(session, receipt(app), order=1)
        with pytest.raises(skiplock.EnqueueError, match="argument 'order_id' is nan"):
            enqueue(session, receipt(app), order_id=float("nan"))
        session.commit()  # the transaction is still good

    assert committed(app) == []


# -- AsyncSession ----------------------------------------------------------------------


def test_async_session_commit_rollback_savepoint_and_bulk(
    engine: Engine, app: skiplock.App, database_url: str
) -> None:
    async def scenario() -> tuple[skiplock.JobState, list[int]]:
        made = async_engine(database_url)
        try:
            async with AsyncSession(made) as session:
                session.add(Order(id=3, item="lamp"))
                ref = await enqueue_async(session, receipt(app), order_id=1)
                state = (await get_job_async(session, ref, app=app)).state
                async with session.begin_nested() as nested:
                    await enqueue_async(session, receipt(app), order_id=2)
                    await nested.rollback()
                await session.commit()

                await enqueue_async(session, receipt(app), order_id=3)
                await session.rollback()

                jobs = [receipt(app).job(order_id=i) for i in range(10, 15)]
                ids = await enqueue_many_async(session, jobs, app=app)
                await session.commit()
            async with made.connect() as conn:  # a Core AsyncConnection
                await enqueue_async(conn, receipt(app), order_id=20)
                await conn.commit()
            return state, ids
        finally:
            await made.dispose()

    state, ids = asyncio.run(scenario())

    assert state is skiplock.JobState.AVAILABLE
    assert len(ids) == 5
    assert committed(app) == [1, 10, 11, 12, 13, 14, 20]


def test_a_workflow_commits_and_rolls_back_with_the_session(
    engine: Engine, app: skiplock.App, database_url: str
) -> None:
    def nightly() -> skiplock.Workflow:
        return skiplock.chain(receipt(app).job(order_id=1), receipt(app).job(order_id=2), app=app)

    with Session(engine) as session:
        session.add(Order(id=5, item="lamp"))
        enqueue_workflow(session, nightly())
        session.rollback()  # the order and both steps go
        with session.begin_nested() as nested:
            enqueue_workflow(session, nightly())
            nested.rollback()
        kept = enqueue_workflow(session, nightly())
        assert committed(app) == []
        session.commit()

    async def in_an_async_session() -> skiplock.WorkflowRef:
        made = async_engine(database_url)
        try:
            async with AsyncSession(made) as session:
                ref = await enqueue_workflow_async(session, nightly())
                await session.commit()
                return ref
        finally:
            await made.dispose()

    also = asyncio.run(in_an_async_session())
    # Only the first step of each is ready; the second waits for it, outside the claim.
    assert committed(app) == [1, 1]
    with app.connect() as conn:
        rows = conn.execute(
            sql.SQL("SELECT workflow_id, count(*) FROM {} GROUP BY 1 ORDER BY 1").format(
                sql.Identifier(SCHEMA, "jobs")
            )
        ).fetchall()
    assert rows == [(kept.id, 2), (also.id, 2)]


# -- other drivers and misuse ------------------------------------------------------------


def test_another_driver_is_refused_naming_the_url_to_use(app: skiplock.App) -> None:
    # module=: the driver is never imported or connected; the check comes first.
    other = create_engine("postgresql+pg8000://u@h/db", module=psycopg)
    with Session(other) as session, pytest.raises(skiplock.ConfigurationError) as refused:
        enqueue(session, receipt(app), order_id=1)

    assert str(refused.value) == (
        "skiplock.contrib.sqlalchemy enqueues through the psycopg 3 driver, but the engine's "
        "URL is postgresql+pg8000://...: create the engine (create_engine or "
        "create_async_engine) with a 'postgresql+psycopg://' URL (pip install "
        "'psycopg[binary]'; the same URL serves sync and async engines)"
    )
    sqlite = Session(create_engine("sqlite://"))
    with pytest.raises(skiplock.ConfigurationError, match=r"needs PostgreSQL.*\(sqlite\)"):
        enqueue(sqlite, receipt(app), order_id=1)


def test_async_driver_refused_and_sync_async_mixups(app: skiplock.App, engine: Engine) -> None:
    asyncpg = types.SimpleNamespace(paramstyle="numeric_dollar", __version__="0.30.0")
    other = create_async_engine("postgresql+asyncpg://u@h/db", module=asyncpg)

    async def scenario() -> None:
        async with AsyncSession(other) as session:
            with pytest.raises(skiplock.ConfigurationError, match=r"postgresql\+asyncpg://"):
                await enqueue_async(session, receipt(app), order_id=1)
        with pytest.raises(TypeError, match="use the functions without _async"):
            await psycopg_connection_async(Session(engine))  # type: ignore[arg-type]

    asyncio.run(scenario())
    with pytest.raises(TypeError, match=r"use the \*_async functions"):
        psycopg_connection(AsyncSession(other))  # type: ignore[arg-type]
