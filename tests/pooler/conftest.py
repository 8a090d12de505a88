"""Fixtures for running skiplock through PgBouncer in transaction pooling mode.

The tests here run only in the PostgreSQL 15 pass (``SKIPLOCK_TEST_DSN`` set): PgBouncer
(Debian's package, ``bouncer.py``) forwards to that server. When it cannot be started the
tests skip, saying why.

Most tests here are the core suite's own (enqueue, claim and complete, retries, lease,
transactional mode, unique keys, cancellation), imported into a module of this folder,
where the fixtures below replace the core ones: ``app``, ``conn`` and ``autocommit`` go
through the pooler (with ``prepare_threshold=None``, as an application behind PgBouncer
< 1.21 must), and every worker is started with ``pooler=True`` plus, by default, a direct
``listen_url`` (``worker_mode``; a module sets it to ``"poll-only"`` to run its workers
with no listener and no liveness lock). Setup and teardown (creating the database,
emptying tables, dropping schemas) stay direct; so do the tests' ``Listener``\\s: LISTEN
does not work through the pooler.
"""

from __future__ import annotations

import getpass
import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import skiplock
from conftest import SCHEMA, StartWorker, WorkerThread, clean_tables
from pooler.bouncer import BouncerUnavailableError, PgBouncer
from semantics.conftest import FAST, Sem, StartWorkers, run_cli

__all__ = ["run_cli"]  # the semantics tests' CLI runner, over ``sem`` (through the pooler)


@pytest.fixture(scope="session")
def bouncer(request: pytest.FixtureRequest, server_url: str) -> Iterator[PgBouncer]:
    if not os.environ.get("SKIPLOCK_TEST_DSN"):
        pytest.skip(
            "PgBouncer tests run in the PostgreSQL 15 pass only (SKIPLOCK_TEST_DSN is unset)"
        )
    database_url: str = request.getfixturevalue("database_url")
    params = conninfo_to_dict(database_url)
    user = str(params.get("user") or getpass.getuser())
    running = PgBouncer()
    try:
        running.start(server_url, [user], [str(params["dbname"])])
    except BouncerUnavailableError as exc:
        pytest.skip(f"PgBouncer could not be started: {exc}")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def pooled_url(bouncer: PgBouncer, database_url: str) -> str:
    """The test database through PgBouncer in transaction mode."""
    return bouncer.url(database_url)


@pytest.fixture
def worker_mode() -> str:
    """How workers reach the database: ``listen-url`` (pooler, plus a direct URL for the
    listener and the heartbeat) or ``poll-only`` (pooler only)."""
    return "listen-url"


def pooler_options(mode: str, direct_url: str) -> dict[str, Any]:
    if mode == "listen-url":
        return {"pooler": True, "listen_url": direct_url}
    assert mode == "poll-only", mode
    return {"pooler": True}


# -- the core fixtures, through the pooler ------------------------------------------------


@pytest.fixture
def app(pooled_url: str, database_url: str) -> skiplock.App:
    clean_tables(database_url)
    return skiplock.App(pooled_url, schema=SCHEMA)


@pytest.fixture
def conn(pooled_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pooled_url, prepare_threshold=None) as connection:
        yield connection
        connection.rollback()


@pytest.fixture
def autocommit(pooled_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as connection:
        yield connection


@pytest.fixture
def start_worker(database_url: str, worker_mode: str) -> Iterator[StartWorker]:
    started: list[WorkerThread] = []

    def start(app: skiplock.App, **options: Any) -> WorkerThread:
        settings = {**pooler_options(worker_mode, database_url), **options}
        handle = WorkerThread(skiplock.Worker(app, **settings))
        started.append(handle)
        return handle.start()

    yield start
    for handle in started:
        handle.stop()


# -- the job-semantics fixtures (tests/semantics), through the pooler --------------------


@pytest.fixture
def sem(pooled_url: str, database_url: str) -> Iterator[Sem]:
    schema = f"sem_{uuid.uuid4().hex[:8]}"
    skiplock.App(database_url, schema=schema).migrate()  # migrations want a direct URL
    yield Sem(pooled_url, schema)
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute("SET lock_timeout = '20s'")
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def workers(sem: Sem, database_url: str, worker_mode: str) -> Iterator[StartWorkers]:
    started: list[WorkerThread] = []

    def start(count: int = 1, **options: Any) -> list[WorkerThread]:
        settings = {**FAST, **pooler_options(worker_mode, database_url), **options}
        handles = [WorkerThread(skiplock.Worker(sem.app, **settings)) for _ in range(count)]
        started.extend(handles)
        for handle in handles:
            handle.start()
        return handles

    yield start
    for handle in started:
        if handle.alive:
            handle.request_stop()
    for handle in started:
        handle.join()
