"""Fixtures: a real PostgreSQL, a fresh database per test run, clean tables per test.

The server is SKIPLOCK_TEST_DSN when set, else the embedded PostgreSQL 18. The database
is created at the start of the run and dropped at the end; nothing relies on leftovers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import skiplock
from skiplock.embedded import embedded_database_url

SCHEMA = "skiplock"


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
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("TRUNCATE {}, {}, {} RESTART IDENTITY").format(
                sql.Identifier(schema, "jobs"),
                sql.Identifier(schema, "job_history"),
                sql.Identifier(schema, "workers"),
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
