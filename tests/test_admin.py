"""skiplock.Admin and skiplock.AsyncAdmin (docs/admin.md): every operation, through each
class and each way of holding the database (a connection, a pool), on real rows.

The four forms run the same tests: ``ops.call("retry_job", 7)`` is the same operation
through Admin on a connection or a pool, or AsyncAdmin on either, on its own event loop.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import skiplock
from conftest import SCHEMA, JobFactory, clean_tables
from skiplock.errors import ConfigurationError, JobNotFoundError

pytestmark = pytest.mark.timeout(60)

FORMS = ["sync-connection", "sync-pool", "async-connection", "async-pool"]


class Ops:
    """One admin operation at a time through one form of the API."""

    def __init__(self, app: skiplock.App, form: str) -> None:
        self.app = app
        self.form = form

    def call(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        url = self.app.database_url
        if self.form == "sync-connection":
            with psycopg.connect(url, autocommit=True) as conn:
                return getattr(skiplock.Admin(self.app, conn), name)(*args, **kwargs)
        if self.form == "sync-pool":
            with ConnectionPool(url, min_size=1, max_size=1) as pool:
                return getattr(skiplock.Admin(self.app, pool), name)(*args, **kwargs)

        async def run() -> Any:
            if self.form == "async-connection":
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                    admin = skiplock.AsyncAdmin(self.app, conn)
                    return await getattr(admin, name)(*args, **kwargs)
            async with AsyncConnectionPool(url, min_size=1, max_size=1) as pool:
                return await getattr(skiplock.AsyncAdmin(self.app, pool), name)(*args, **kwargs)

        return asyncio.run(run())


@pytest.fixture(params=FORMS)
def ops(request: pytest.FixtureRequest, app: skiplock.App) -> Ops:
    return Ops(app, request.param)


def state_of(app: skiplock.App, job_id: int) -> tuple[str, str] | None:
    """(table, state) of a job: "jobs" while live, "job_history" once finished."""
    with app.connect() as conn:
        for table in ("jobs", "job_history"):
            row = conn.execute(
                sql.SQL("SELECT state FROM {} WHERE id = %s").format(
                    sql.Identifier(app.schema, table)
                ),
                (job_id,),
            ).fetchone()
            if row is not None:
                return table, str(row[0])
    return None


def running_job(make_job: JobFactory) -> int:
    """A job a worker holds, its lease an hour long."""
    return make_job(
        state="running",
        worker_id=uuid.uuid4(),
        attempts=1,
        lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
    )


# -- jobs ------------------------------------------------------------------------------


def test_get_job_reads_a_live_job_and_a_missing_one_is_not_found(
    ops: Ops, make_job: JobFactory
) -> None:
    job_id = make_job(task="admin.get", args={"n": 1}, queue="q1")

    job = ops.call("get_job", job_id)

    assert (job.id, job.task, job.args, job.queue, job.state) == (
        job_id,
        "admin.get",
        {"n": 1},
        "q1",
        "available",
    )
    with pytest.raises(JobNotFoundError, match="no job with id 999999"):
        ops.call("get_job", 999_999)


def test_list_jobs_and_job_ids_apply_every_filter(ops: Ops, make_job: JobFactory) -> None:
    dead = make_job(queue="q1", state="dead", attempts=3)
    make_job(queue="q1", state="available")
    other = make_job(queue="q2", state="dead", attempts=3)

    assert [j.id for j in ops.call("list_jobs", state="dead")] == [dead, other]
    assert [j.id for j in ops.call("list_jobs", state="dead", queue="q1")] == [dead]
    assert len(ops.call("list_jobs", limit=2)) == 2
    assert ops.call("job_ids", state="dead") == [dead, other]
    assert ops.call("job_ids", queue="q2") == [other]
    assert ops.call("job_ids", older_than=3600) == []


def test_retry_job_sends_a_dead_job_back_and_refuses_a_running_one(
    ops: Ops, app: skiplock.App, make_job: JobFactory
) -> None:
    dead = make_job(state="dead", attempts=3, errors=[{"message": "boom"}])
    running = running_job(make_job)

    ops.call("retry_job", dead)

    job = ops.call("get_job", dead)
    assert (job.state, job.attempts) == ("available", 0)
    with pytest.raises(JobNotFoundError, match=f"job {running} is running"):
        ops.call("retry_job", running)
    assert state_of(app, running) == ("jobs", "running")


def test_cancel_job_moves_a_waiting_job_to_history_and_asks_a_running_one_to_stop(
    ops: Ops, app: skiplock.App, make_job: JobFactory
) -> None:
    waiting = make_job()
    running = running_job(make_job)

    ops.call("cancel_job", waiting)
    ops.call("cancel_job", running)

    assert state_of(app, waiting) == ("job_history", "cancelled")
    assert state_of(app, running) == ("jobs", "running")
    assert ops.call("get_job", running).cancel_requested_at is not None
    with pytest.raises(JobNotFoundError, match=r"has finished \(cancelled\) and is in history"):
        ops.call("cancel_job", waiting)


def test_delete_job_leaves_no_history_and_refuses_a_running_one(
    ops: Ops, app: skiplock.App, make_job: JobFactory
) -> None:
    job_id = make_job(state="dead", attempts=3)
    running = running_job(make_job)

    ops.call("delete_job", job_id)

    assert state_of(app, job_id) is None
    with pytest.raises(JobNotFoundError, match="only jobs not running can be deleted"):
        ops.call("delete_job", running)


def test_bulk_changes_count_what_they_changed_and_leave_running_jobs(
    ops: Ops, app: skiplock.App, make_job: JobFactory
) -> None:
    dead = [make_job(state="dead", attempts=3) for _ in range(3)]
    running = running_job(make_job)

    assert ops.call("retry_jobs", [*dead, running]) == 3
    assert ops.call("cancel_jobs", dead[:2]) == 2
    assert ops.call("delete_jobs", [dead[2], running]) == 1
    assert [state_of(app, i) for i in [*dead, running]] == [
        ("job_history", "cancelled"),
        ("job_history", "cancelled"),
        None,
        ("jobs", "running"),
    ]
    assert ops.call("retry_jobs", []) == 0


# -- queues and workers ------------------------------------------------------------------


def test_pause_and_resume_a_queue(ops: Ops) -> None:
    ops.call("pause_queue", "reports")

    assert ops.call("paused_queues") == ["reports"]
    assert [(q["name"], q["paused"]) for q in ops.call("queue_settings")] == [("reports", True)]

    ops.call("resume_queue", "reports")

    assert ops.call("paused_queues") == []


def test_queue_limits_are_set_checked_and_removed(ops: Ops) -> None:
    ops.call("set_queue_limits", "q1", concurrency=2, rate="10/s")

    [row] = ops.call("queue_settings")
    assert (row["concurrency_limit"], row["rate_limit"], row["rate_period"]) == (2, 10, 1.0)
    with pytest.raises(ConfigurationError, match="concurrency must be an integer"):
        ops.call("set_queue_limits", "q1", concurrency=0)
    with pytest.raises(ConfigurationError, match="queue name"):
        ops.call("pause_queue", "")

    ops.call("set_queue_limits", "q1")

    [row] = ops.call("queue_settings")
    assert (row["concurrency_limit"], row["rate_limit"]) == (None, None)


def test_queue_stats_and_workers(ops: Ops, make_job: JobFactory) -> None:
    make_job(queue="q1")
    make_job(queue="q1", state="dead", attempts=3)

    [row] = ops.call("queue_stats")

    assert (row["queue"], row["available"], row["dead"]) == ("q1", 1, 1)
    assert ops.call("workers") == []


# -- transactions, construction, routes ----------------------------------------------------


def test_a_change_inside_the_callers_transaction_is_undone_with_it(
    app: skiplock.App, make_job: JobFactory
) -> None:
    job_id = make_job(state="dead", attempts=3)
    with app.connect() as conn:
        admin = skiplock.Admin(app, conn)
        with conn.transaction(force_rollback=True):
            admin.delete_job(job_id)
            assert state_of(app, job_id) == ("jobs", "dead")  # not committed yet
        assert state_of(app, job_id) == ("jobs", "dead")
        # With no transaction open, the change is committed when the call returns.
        admin.delete_job(job_id)
        assert state_of(app, job_id) is None


def test_async_admin_inside_the_callers_transaction_commits_with_it(
    app: skiplock.App, make_job: JobFactory
) -> None:
    job_id = make_job()

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(app.database_url) as conn:
            admin = skiplock.AsyncAdmin(app, conn)
            async with conn.transaction():
                await admin.cancel_job(job_id)
                assert state_of(app, job_id) == ("jobs", "available")
            assert state_of(app, job_id) == ("job_history", "cancelled")

    asyncio.run(run())


def test_each_class_refuses_the_other_kind_of_connection(app: skiplock.App) -> None:
    with pytest.raises(ConfigurationError, match=r"Admin takes a psycopg\.Connection"):
        skiplock.Admin(app, "postgresql:///x")  # type: ignore[arg-type]

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(app.database_url) as conn:
            with pytest.raises(ConfigurationError, match="got AsyncConnection"):
                skiplock.Admin(app, conn)  # type: ignore[arg-type]

    asyncio.run(run())
    with app.connect() as conn, pytest.raises(ConfigurationError, match="AsyncAdmin takes"):
        skiplock.AsyncAdmin(app, conn)  # type: ignore[arg-type]


@pytest.fixture
def reports_database(server_url: str, database_url: str) -> Iterator[str]:
    """A second migrated database on the test server, for queue "reports"."""
    name = f"skiplock_admin_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = {k: str(v) for k, v in conninfo_to_dict(server_url).items() if v is not None}
    url = make_conninfo("", **{**params, "dbname": name})
    try:
        skiplock.App(url, schema=SCHEMA).migrate()
        yield url
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.mark.parametrize("form", ["sync", "async"])
def test_with_routes_a_queue_is_changed_only_on_its_own_database(
    form: str, database_url: str, reports_database: str
) -> None:
    clean_tables(database_url)
    app = skiplock.App(database_url, schema=SCHEMA, queue_databases={"reports": reports_database})

    def pause(url: str, queue: str) -> None:
        if form == "sync":
            with psycopg.connect(url, autocommit=True) as conn:
                skiplock.Admin(app, conn).pause_queue(queue)
            return

        async def run() -> None:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await skiplock.AsyncAdmin(app, conn).pause_queue(queue)

        asyncio.run(run())

    with pytest.raises(ConfigurationError, match="queue 'reports' lives on database"):
        pause(database_url, "reports")
    pause(reports_database, "reports")
    pause(database_url, "emails")

    on_reports = Ops(skiplock.App(reports_database, schema=SCHEMA), f"{form}-connection")
    on_default = Ops(skiplock.App(database_url, schema=SCHEMA), f"{form}-connection")
    assert on_reports.call("paused_queues") == ["reports"]
    assert on_default.call("paused_queues") == ["emails"]
