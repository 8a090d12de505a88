"""Queues over several databases (docs/routing.md, decision 020): the routing table's
checks, enqueue routed to each queue's database (and refused on another's connection), one
worker serving queues on two databases, and status and migrate covering both. Real
databases: two on the test server, and two servers (the test server and the embedded
PostgreSQL 18, when it runs)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import skiplock
from conftest import SCHEMA, clean_tables, wait_until
from skiplock.errors import ConfigurationError, EnqueueError, SchemaNotReadyError
from skiplock.routing import group_queues, same_database_urls, single_database
from skiplock.worker.routed import RoutedWorker

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def scratch_database(server_url: str, *, migrated: bool = True) -> Iterator[str]:
    """A database of its own on ``server_url``'s server, dropped at the end."""
    name = f"skiplock_routing_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = {k: str(v) for k, v in conninfo_to_dict(server_url).items() if v is not None}
    params["dbname"] = name
    url = make_conninfo("", **params)
    try:
        if migrated:
            skiplock.App(url, schema=SCHEMA).migrate()
        yield url
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(scope="module")
def reports_url(server_url: str) -> Iterator[str]:
    """A second database on the test server, for queue "reports"."""
    with scratch_database(server_url) as url:
        yield url


@pytest.fixture(scope="module")
def embedded_reports_url() -> Iterator[str]:
    """A database on the embedded PostgreSQL 18: a second server."""
    try:
        from skiplock.embedded import running_embedded_server  # noqa: PLC0415

        server = running_embedded_server()
    except (ImportError, ConfigurationError) as exc:
        pytest.skip(f"the embedded PostgreSQL is not available: {exc}")
    if server is None:
        pytest.skip("the embedded PostgreSQL is not running (`skiplock embedded url` starts it)")
    with scratch_database(server.url) as url:
        yield url


def routed_app(default_url: str, reports_url: str) -> skiplock.App:
    clean_tables(default_url)
    clean_tables(reports_url)
    app = skiplock.App(default_url, schema=SCHEMA, queue_databases={"reports": reports_url})

    @app.task(queue="reports", name="routing.report")
    def report(n: int) -> dict[str, Any]:
        return {"n": n, "queue": "reports"}

    @app.task(queue="emails", name="routing.email")
    async def email(n: int) -> dict[str, Any]:
        return {"n": n}

    return app


def jobs_on(url: str) -> list[tuple[str, str]]:
    """(queue, task) of every live job on ``url``'s database."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            sql.SQL("SELECT queue, task FROM {} ORDER BY id").format(sql.Identifier(SCHEMA, "jobs"))
        ).fetchall()
    return [(str(q), str(t)) for q, t in rows]


def completed_on(url: str) -> dict[str, int]:
    """Completed jobs per queue in ``url``'s history."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT queue, count(*) FROM {} WHERE state = 'completed' GROUP BY queue"
            ).format(sql.Identifier(SCHEMA, "job_history"))
        ).fetchall()
    return {str(q): int(n) for q, n in rows}


class RoutedThread:
    """A real RoutedWorker on its own event loop and thread."""

    def __init__(self, worker: RoutedWorker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.worker.run_async())
        except BaseException as exc:
            self.error = exc

    def start(self) -> RoutedThread:
        self.thread.start()
        wait_until(
            lambda: self.worker.ready or not self.thread.is_alive(), 30, "the workers to start"
        )
        return self

    def stop(self) -> None:
        self.worker.request_stop()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the workers did not stop in time"
        if self.error is not None:
            raise self.error


# -- the routing table -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ({"": "postgresql:///x"}, "queue"),
        ({"bad queue!": "postgresql:///x"}, "queue"),
        (
            {"reports": ""},
            "queue_databases['reports']: expected postgresql://USER@HOST:PORT/DBNAME",
        ),
        ({"reports": 5}, "queue_databases['reports']: expected postgresql://USER@HOST:PORT/DBNAME"),
        ({"reports": "postgresql://u:secret@h/db?bogus=1"}, "is malformed"),
        (["reports"], "queue_databases must map queue names to database URLs"),
    ],
)
def test_a_bad_routing_table_fails_at_construction(routes: Any, message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        skiplock.App("postgresql:///main", queue_databases=routes)

    assert message in str(raised.value)
    assert "secret" not in str(raised.value)


def test_queues_group_by_database_default_first() -> None:
    routes = {"reports": "postgresql:///r", "audit": "postgresql:///r", "bulk": "postgresql:///b"}

    groups = group_queues(["bulk", "reports", "emails", "audit", "default"], "main", routes)

    assert groups == {
        "main": ["emails", "default"],
        "postgresql:///b": ["bulk"],
        "postgresql:///r": ["reports", "audit"],
    }
    assert single_database(["reports", "audit"], "main", routes) == "postgresql:///r"
    with pytest.raises(EnqueueError, match="several databases"):
        single_database(["reports", "emails"], "main", routes)


def test_each_database_gets_the_periodic_tasks_of_its_queues() -> None:
    app = skiplock.App("postgresql:///main", queue_databases={"reports": "postgresql:///r"})

    @app.periodic("* * * * *", queue="reports", name="routing.nightly_report")
    def nightly() -> None: ...

    @app.periodic("* * * * *", name="routing.cleanup")
    def cleanup() -> None: ...

    main, reports = (app._for_database(url) for url in app.databases())

    assert app.databases() == ["postgresql:///main", "postgresql:///r"]
    assert list(main.periodics) == ["routing.cleanup"]
    assert list(reports.periodics) == ["routing.nightly_report"]
    assert reports.tasks is app.tasks and not reports.queue_databases
    with pytest.raises(ConfigurationError, match="not a database of this App"):
        app._for_database("postgresql:///elsewhere")


def test_a_worker_refuses_queues_that_live_on_another_database() -> None:
    app = skiplock.App("postgresql:///main", queue_databases={"reports": "postgresql:///r"})

    @app.periodic("* * * * *", queue="reports", name="routing.nightly_report")
    def nightly() -> None: ...

    @app.periodic("* * * * *", name="routing.cleanup")
    def cleanup() -> None: ...

    with pytest.raises(ConfigurationError) as refused:
        skiplock.Worker(app, queues=["default", "reports"])
    assert "queues 'reports' live on other databases" in str(refused.value)
    assert "skiplock.worker.routed.RoutedWorker" in str(refused.value)

    # Its queues all on database_url: it serves them, and ticks only their schedules.
    worker = skiplock.Worker(app, queues=["default"])
    assert worker.app.database_url == "postgresql:///main"
    assert list(worker.app.periodics) == ["routing.cleanup"]


def test_urls_are_the_same_database_when_their_servers_say_so() -> None:
    one, other = ("7300000000000000001", "16384"), ("7300000000000000001", "16385")

    same = same_database_urls({"a": one, "b": other, "a again": one, "unknown": None})

    assert same == {
        "a": ["a", "a again"],
        "b": ["b"],
        "a again": ["a", "a again"],
        "unknown": ["unknown"],
    }


# -- enqueue -----------------------------------------------------------------------------


def test_enqueue_goes_to_the_queue_database_in_the_callers_transaction(
    database_url: str, reports_url: str
) -> None:
    app = routed_app(database_url, reports_url)
    report, email = app.tasks["routing.report"], app.tasks["routing.email"]

    with app.connect(queue="reports") as conn:
        report.enqueue(conn, n=1)
        app.enqueue_many(conn, [report.job(n=2), report.job(n=3)])
        with pytest.raises(ZeroDivisionError), conn.transaction():
            report.enqueue(conn, n=4)  # rolled back with the caller's transaction
            _ = 1 / 0
    with app.connect() as conn:
        email.enqueue(conn, n=1)

    assert jobs_on(reports_url) == [("reports", "routing.report")] * 3
    assert jobs_on(database_url) == [("emails", "routing.email")]


def test_enqueue_on_another_databases_connection_is_refused(
    database_url: str, reports_url: str
) -> None:
    app = routed_app(database_url, reports_url)
    report, email = app.tasks["routing.report"], app.tasks["routing.email"]

    with app.connect() as conn:
        with pytest.raises(EnqueueError) as refused:
            report.enqueue(conn, n=1)
        conn.rollback()
        with pytest.raises(EnqueueError, match="several databases") as mixed:
            app.enqueue_many(conn, [report.job(n=1), email.job(n=1)])
    with app.connect(queue="reports") as conn, pytest.raises(EnqueueError):
        email.enqueue(conn, n=1)

    message = str(refused.value)
    reports_db = conninfo_to_dict(reports_url)["dbname"]
    default_db = conninfo_to_dict(database_url)["dbname"]
    assert "queue 'reports' lives on database" in message
    assert f"/{reports_db}" in message and f"/{default_db}" in message
    assert "app.connect(queue='reports')" in message
    assert "app.connect(queue=...)" in str(mixed.value)
    assert jobs_on(reports_url) == [] and jobs_on(database_url) == []


def test_a_connection_is_matched_by_its_database_not_its_url(
    database_url: str, reports_url: str
) -> None:
    app = routed_app(database_url, reports_url)
    other_spelling = make_conninfo(reports_url, application_name="another-url-same-database")

    with psycopg.connect(other_spelling) as conn:
        app.tasks["routing.report"].enqueue(conn, n=1)

    assert jobs_on(reports_url) == [("reports", "routing.report")]


def test_async_enqueue_is_routed_and_refused_alike(database_url: str, reports_url: str) -> None:
    app = routed_app(database_url, reports_url)
    report = app.tasks["routing.report"]

    async def main() -> None:
        url = app.database_url_for("reports")
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await report.enqueue_async(conn, n=1)
            await app.enqueue_many_async(conn, [report.job(n=2)])
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            with pytest.raises(EnqueueError, match="lives on database"):
                await report.enqueue_async(conn, n=3)

    asyncio.run(main())

    assert len(jobs_on(reports_url)) == 2 and jobs_on(database_url) == []


# -- one worker, two databases -----------------------------------------------------------


def drain_both(default_url: str, reports_url: str) -> None:
    """Enqueue on both databases, drain them with one RoutedWorker, wait for results."""
    app = routed_app(default_url, reports_url)
    report, email = app.tasks["routing.report"], app.tasks["routing.email"]
    with app.connect(queue="reports") as conn:
        app.enqueue_many(conn, [report.job(n=n) for n in range(50)])
        waited = report.enqueue(conn, n=99)
    with app.connect() as conn:
        app.enqueue_many(conn, [email.job(n=n) for n in range(50)])

    worker = RoutedWorker(app, queues=["emails", "reports"], concurrency=4)
    assert [w.app.database_url for w in worker.workers] == [default_url, reports_url]
    running = RoutedThread(worker).start()
    try:
        assert waited.result(timeout=60) == {"n": 99, "queue": "reports"}
        wait_until(
            lambda: (
                completed_on(reports_url) == {"reports": 51}
                and completed_on(default_url) == {"emails": 50}
            ),
            60,
            "both databases to drain",
        )
    finally:
        running.stop()
    assert jobs_on(reports_url) == [] and jobs_on(default_url) == []


def test_one_worker_drains_queues_on_two_databases_of_one_server(
    database_url: str, reports_url: str
) -> None:
    drain_both(database_url, reports_url)


def test_one_worker_drains_queues_on_two_servers(
    database_url: str, embedded_reports_url: str
) -> None:
    drain_both(database_url, embedded_reports_url)


def test_a_database_without_migrations_stops_the_whole_worker(
    server_url: str, database_url: str
) -> None:
    with scratch_database(server_url, migrated=False) as bare_url:
        app = skiplock.App(database_url, schema=SCHEMA, queue_databases={"reports": bare_url})
        worker = RoutedWorker(app, queues=["default", "reports"], concurrency=2)

        with pytest.raises(SchemaNotReadyError, match="skiplock migrate"):
            asyncio.run(asyncio.wait_for(worker.run_async(), 60))


# -- the CLI: migrate, status and worker over every database -----------------------------


def cli_env(default_url: str, reports_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_SCHEMA"}
    env["SKIPLOCK_DATABASE_URL"] = default_url
    env["SKIPLOCK_TEST_REPORTS_URL"] = reports_url
    return env


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skiplock", *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
        check=False,
    )


def test_migrate_and_status_cover_every_database_of_the_app(
    server_url: str, database_url: str
) -> None:
    with scratch_database(server_url, migrated=False) as bare_url:
        env = cli_env(database_url, bare_url)
        migrated = run_cli(env, "migrate", "--app", "tests.routing_app:app")
        app = routed_app(database_url, bare_url)
        report = app.tasks["routing.report"]
        with app.connect(queue="reports") as conn:
            report.enqueue(conn, n=1)
        status = run_cli(env, "status", "--app", "tests.routing_app:app", "--json")
        text = run_cli(env, "status", "--app", "tests.routing_app:app")

    assert migrated.returncode == 0, migrated.stderr
    bare_db = conninfo_to_dict(bare_url)["dbname"]
    default_db = conninfo_to_dict(database_url)["dbname"]
    assert f"/{default_db} " in migrated.stdout and "up to date" in migrated.stdout
    assert f"/{bare_db} " in migrated.stdout and "applied 0001_jobs" in migrated.stdout
    assert status.returncode == 0, status.stderr
    queues = json.loads(status.stdout)["queues"]
    assert [(row["queue"], row["available"]) for row in queues] == [("reports", 1)]
    assert queues[0]["database"].endswith(f"/{bare_db}")
    headers = [line for line in text.stdout.splitlines() if line.startswith("database ")]
    assert [h.rsplit("/", 1)[1] for h in headers] == [default_db, bare_db]


def test_the_worker_command_serves_both_databases_and_status_shows_both(
    database_url: str, reports_url: str
) -> None:
    app = routed_app(database_url, reports_url)
    report, email = app.tasks["routing.report"], app.tasks["routing.email"]
    with app.connect(queue="reports") as conn:
        app.enqueue_many(conn, [report.job(n=n) for n in range(20)])
    with app.connect() as conn:
        app.enqueue_many(conn, [email.job(n=n) for n in range(20)])
    env = cli_env(database_url, reports_url)

    worker = subprocess.Popen(
        [sys.executable, "-m", "skiplock", "worker", "tests.routing_app:app"],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: (
                completed_on(reports_url) == {"reports": 20}
                and completed_on(database_url) == {"emails": 20}
            ),
            60,
            "the worker process to drain both databases",
        )
        status = run_cli(env, "status", "--app", "tests.routing_app:app", "--json")
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)

    assert worker.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert status.returncode == 0, status.stderr
    workers = json.loads(status.stdout)["workers"]
    # One process, registered on each database it serves, with that database's queues.
    assert sorted((w["database"].rsplit("/", 1)[1], w["queues"]) for w in workers) == sorted(
        [
            (conninfo_to_dict(database_url)["dbname"], ["emails"]),
            (conninfo_to_dict(reports_url)["dbname"], ["reports"]),
        ]
    )
    assert len({w["pid"] for w in workers}) == 1


# -- one database under two URLs ---------------------------------------------------------

YEARLY = "0 0 1 1 *"  # only the tick made due below can come due during a test


def spelled_twice(database_url: str) -> skiplock.App:
    """An App whose routing table names its own database again, under another URL: two
    Workers on one database (one leader), each database's share of the schedules."""
    clean_tables(database_url)
    other = make_conninfo(database_url, application_name="skiplock-another-spelling")
    app = skiplock.App(database_url, schema=SCHEMA, queue_databases={"reports": other})

    @app.periodic(YEARLY, queue="reports", name="routing.yearly_report")
    def yearly_report() -> None: ...

    @app.periodic(YEARLY, name="routing.yearly_cleanup")
    def yearly_cleanup() -> None: ...

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (name, last_tick) SELECT name, "
                "date_trunc('year', now()) - interval '1 year' FROM unnest(%s::text[]) AS name"
            ).format(sql.Identifier(SCHEMA, "periodic")),
            (list(app.periodics),),
        )
    return app


def jobs_of(url: str, task: str) -> int:
    """Jobs of ``task`` on ``url``'s database, live or finished."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT (SELECT count(*) FROM {} WHERE task = %(task)s) "
                "+ (SELECT count(*) FROM {} WHERE task = %(task)s)"
            ).format(sql.Identifier(SCHEMA, "jobs"), sql.Identifier(SCHEMA, "job_history")),
            {"task": task},
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("queues", [["default", "reports"], ["default"], ["reports"]])
def test_one_database_under_two_urls_ticks_every_schedule_once(
    database_url: str, queues: list[str]
) -> None:
    """Whichever of the two Workers leads, and whichever queues the process serves,
    every schedule whose queue lives on that database ticks, once."""
    app = spelled_twice(database_url)
    worker = RoutedWorker(app, queues=queues, poll_interval=0.05, rescue_interval=0.05)
    running = RoutedThread(worker).start()
    try:
        wait_until(
            lambda: all(jobs_of(database_url, name) for name in app.periodics),
            20,
            "every schedule to tick",
        )
    finally:
        running.stop()

    assert {name: jobs_of(database_url, name) for name in app.periodics} == {
        "routing.yearly_report": 1,
        "routing.yearly_cleanup": 1,
    }
