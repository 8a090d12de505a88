"""Fixtures: a real PostgreSQL, a fresh database per test run, clean tables per test.

The server is SKIPLOCK_TEST_DSN when set, else the embedded PostgreSQL 18. The database
is created at the start of the run and dropped at the end; nothing relies on leftovers.

Besides fixtures, this module holds the few helpers tests import (``from conftest import
...``): ``wait_until`` (poll a condition with a deadline, never sleep-and-hope),
``WorkerThread`` (a real worker on its own event loop), ``JobFactory`` (a row in any state)
and ``Listener`` (LISTEN with a sentinel, so "no notification" is checked without waiting).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

import skiplock
from skiplock.embedded import embedded_database_url
from skiplock.sql import render, wakeup

SCHEMA = "skiplock"
CHANNEL = f"{SCHEMA}.jobs"
T = TypeVar("T")

# Suites whose tests must not run side by side, under pytest-xdist's ``--dist loadgroup``:
# each is an xdist group (named after its folder), run on one xdist worker one test at a
# time. cluster and failover build network namespaces and servers of their own (named
# after their process, so the two suites may run at once), pooler a pgbouncer, and the
# chaos scenarios drive several worker processes flat out for their figures. Every other
# test is independent: each xdist worker has its own database (``database_url``).
SERIAL_SUITES = frozenset({"cluster", "failover", "pooler", "chaos"})


# Long tests that do not depend on the server, run once: with the second server's half
# of scripts/test, which ends minutes before the first server's (marker second_server).
ON_THE_SECOND_SERVER = pytest.mark.skip(
    reason="runs once, against the second server (scripts/test's embedded half: "
    "unset SKIPLOCK_TEST_DSN to run it)"
)


# Long suites whose outcome does not depend on the server's version: cluster and failover
# build servers of their own (from the PostgreSQL 15 binaries, whatever SKIPLOCK_TEST_DSN
# names), chaos drives worker processes against the test database or a private server.
# Their tests are second_server, run once, in the half of scripts/test that would
# otherwise end minutes before the other; those marked server_version still run on both.
SECOND_SERVER_SUITES = frozenset({"cluster", "failover", "chaos"})


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    first_server = bool(os.environ.get("SKIPLOCK_TEST_DSN"))
    for item in items:
        suite = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
        if suite in SECOND_SERVER_SUITES and item.get_closest_marker("server_version") is None:
            item.add_marker(pytest.mark.second_server)
        if first_server and item.get_closest_marker("second_server") is not None:
            item.add_marker(ON_THE_SECOND_SERVER)
        if suite in SERIAL_SUITES:
            item.add_marker(pytest.mark.xdist_group(suite))


@pytest.fixture(scope="session")
def server_url() -> str:
    return os.environ.get("SKIPLOCK_TEST_DSN") or embedded_database_url()


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    name = f"skiplock_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = {k: str(v) for k, v in conninfo_to_dict(server_url).items() if v is not None}
    params["dbname"] = name
    url = make_conninfo("", **params)
    skiplock.App(url, schema=SCHEMA).migrate()
    yield url
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def clean_tables(url: str, schema: str = SCHEMA) -> None:
    """Empty every table of the schema but the migration ledger (partitions with their
    parents), so no state of an earlier test (a paused queue, a leader) leaks into the next."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT c.relname FROM pg_class c "
            "WHERE c.relnamespace = %s::regnamespace AND c.relkind IN ('r', 'p') "
            "AND NOT c.relispartition AND c.relname <> 'schema_migrations' ORDER BY 1",
            (schema,),
        ).fetchall()
        conn.execute(
            sql.SQL("TRUNCATE {} RESTART IDENTITY").format(
                sql.SQL(", ").join(sql.Identifier(schema, name) for (name,) in tables)
            )
        )


@pytest.fixture
def app(database_url: str) -> skiplock.App:
    """A fresh App over empty tables (tests that commit need clean tables)."""
    clean_tables(database_url)
    return skiplock.App(database_url, schema=SCHEMA)


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection whose transaction is rolled back at the end of the test."""
    with psycopg.connect(database_url) as connection:
        yield connection
        connection.rollback()


@pytest.fixture
def autocommit(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        yield connection


# -- waiting ---------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    interval: float | None = None,
    check: Callable[[], object] | Sequence[Callable[[], object]] = (),
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Fails with ``what`` after ``timeout`` seconds, or at once when ``check`` (or one of
    several) raises: a worker process that died, say. Polls every ``interval`` seconds,
    or by default every few milliseconds at first and then every 50 ms.
    """
    deadline = time.monotonic() + timeout
    checks = (check,) if callable(check) else tuple(check)
    pause = interval if interval is not None else 0.005
    while True:
        for each in checks:
            each()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(pause)
        if interval is None:
            pause = min(pause * 2, 0.05)


# -- rows in any state -----------------------------------------------------------------


class JobFactory:
    """Writes a job row directly, in any state and with any timestamps, and commits it.

    Rows written this way bypass every check the Python client makes, as a plain SQL
    INSERT by another program would.
    """

    def __init__(self, url: str, schema: str = SCHEMA) -> None:
        self.url = url
        self.schema = schema

    def __call__(
        self,
        *,
        task: str = "noop",
        args: dict[str, Any] | None = None,
        queue: str = "default",
        state: str = "available",
        priority: int = 0,
        run_at: datetime | None = None,
        attempts: int = 0,
        max_attempts: int = 3,
        errors: list[dict[str, Any]] | None = None,
        worker_id: uuid.UUID | None = None,
        lease_expires_at: datetime | None = None,
    ) -> int:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL(
                    "INSERT INTO {} (task, args, queue, state, priority, run_at, attempts, "
                    "max_attempts, errors, worker_id, lease_expires_at) "
                    "VALUES (%s, %s, %s, %s, %s, COALESCE(%s, now()), %s, %s, %s, %s, %s) "
                    "RETURNING id"
                ).format(sql.Identifier(self.schema, "jobs")),
                (
                    task,
                    Jsonb(args or {}),
                    queue,
                    state,
                    priority,
                    run_at,
                    attempts,
                    max_attempts,
                    Jsonb(errors or []),
                    worker_id,
                    lease_expires_at,
                ),
            ).fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def make_job(app: skiplock.App) -> JobFactory:
    """A job factory over the (clean) tables of ``app``."""
    return JobFactory(app.database_url, app.schema)


# -- workers ---------------------------------------------------------------------------


class WorkerThread:
    """A real ``skiplock.Worker`` running ``run_async`` on its own event loop and thread."""

    def __init__(self, worker: skiplock.Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="test-worker", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.worker.run_async())
        except BaseException as exc:
            self.error = exc

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def start(self, timeout: float = 20.0) -> WorkerThread:
        self.thread.start()
        wait_until(
            lambda: self.worker.ready.is_set() or not self.alive, timeout, "the worker to start"
        )
        self._raise_error()
        assert self.worker.ready.is_set()
        return self

    def request_stop(self) -> None:
        self.worker.request_stop()

    def join(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        assert not self.alive, "the worker did not stop in time"
        self._raise_error()

    def stop(self, timeout: float = 30.0) -> None:
        if self.alive:
            self.request_stop()
            self.join(timeout)
        self._raise_error()

    def _raise_error(self) -> None:
        """Raise what the worker died of, once."""
        error, self.error = self.error, None
        if error is not None:
            raise error


StartWorker = Callable[..., WorkerThread]


@pytest.fixture
def start_worker() -> Iterator[StartWorker]:
    """Start a worker (keyword arguments go to ``skiplock.Worker``); stopped at teardown."""
    started: list[WorkerThread] = []

    def start(app: skiplock.App, **options: Any) -> WorkerThread:
        handle = WorkerThread(skiplock.Worker(app, **options))
        started.append(handle)
        return handle.start()

    yield start
    for handle in started:
        handle.stop()


# -- notifications ---------------------------------------------------------------------


class Listener:
    """LISTEN on a channel from its own autocommit connection.

    ``collect`` sends a sentinel NOTIFY and returns the queues woken before it (a payload
    is the queue name, optionally followed by tab-separated position hints). A session's
    notifications are delivered in commit order, so "nothing before the sentinel" proves
    nothing was sent by transactions that committed (or rolled back) earlier, without
    waiting for a timeout.
    """

    def __init__(self, url: str, channel: str = CHANNEL) -> None:
        self.url = url
        self.channel = channel
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def collect_payloads(self, timeout: float = 10.0) -> list[str]:
        """Like ``collect``, the whole payloads."""
        return self.collect(timeout, whole=True)

    def collect(self, timeout: float = 10.0, *, whole: bool = False) -> list[str]:
        sentinel = f"sentinel-{uuid.uuid4().hex}"
        with psycopg.connect(self.url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (self.channel, sentinel))
        queues: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"the sentinel notification did not arrive in {timeout}s")
            for note in self.conn.notifies(timeout=remaining, stop_after=1):
                if note.payload == sentinel:
                    return queues
                queues.append(note.payload if whole else note.payload.split("\t", 1)[0])

    def wait_on(self, *queues: str, schema: str = "skiplock") -> None:
        """Hold the sentinel keys of ``queues`` from this connection, as an idle worker
        does (decision 023): inserts into them notify from now on."""
        for queue in queues:
            row = self.conn.execute(
                render(wakeup.SENTINEL_ARM, schema), {"queue": queue, "schema": schema}
            ).fetchone()
            assert row == ("armed",), (queue, row)

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def listener(database_url: str) -> Iterator[Listener]:
    """Listening on the ``skiplock.jobs`` channel before the test starts."""
    listening = Listener(database_url)
    yield listening
    listening.close()


# -- schemas ---------------------------------------------------------------------------


@pytest.fixture
def scratch_schemas(database_url: str) -> Iterator[Callable[[], str]]:
    """Makes schema names no one uses yet (nothing is created); all dropped after the test."""
    names: list[str] = []

    def new() -> str:
        names.append(f"mig_{uuid.uuid4().hex[:12]}")
        return names[-1]

    yield new
    with psycopg.connect(database_url, autocommit=True) as admin:
        for name in names:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def scratch_schema(scratch_schemas: Callable[[], str]) -> str:
    """One unused schema name, dropped after the test."""
    return scratch_schemas()
