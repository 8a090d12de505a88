"""skiplock's pytest plugin: fixtures over a real PostgreSQL (docs/testing.md).

pytest loads it in every project where skiplock is installed, so it only defines
fixtures, each named ``skiplock_*``, and one ini setting: nothing runs, connects or
imports more of skiplock until a test asks for a fixture. ``-p no:skiplock`` turns it off.

- ``skiplock_database_url`` (session): ``SKIPLOCK_TEST_DATABASE_URL``, else
  ``SKIPLOCK_DATABASE_URL`` ("embedded" starts the embedded server).
- ``skiplock_schema`` (session): a throwaway schema, migrated, dropped at the end.
- ``skiplock_app`` (session): your App (ini ``skiplock_app = "module:attribute"``, or
  override the fixture), pointed at that database and schema for the session.
- ``skiplock_conn``: a connection whose transaction rolls back at the end of the test.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import psycopg

    from skiplock.app import App

TEST_DATABASE_URL_ENV = "SKIPLOCK_TEST_DATABASE_URL"
APP_SETTING = "skiplock_app"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        APP_SETTING,
        "the skiplock.App your tasks are registered on, as module:attribute; the skiplock_* "
        "fixtures point it at a throwaway schema (see skiplock's docs/testing.md)",
        default=None,
    )


@pytest.fixture(scope="session")
def skiplock_database_url() -> str:
    """The database the skiplock fixtures use: SKIPLOCK_TEST_DATABASE_URL, else
    SKIPLOCK_DATABASE_URL. Override this fixture to choose it another way."""
    from skiplock.config import resolve_database_url  # noqa: PLC0415 - only when used
    from skiplock.errors import ConfigurationError  # noqa: PLC0415

    try:
        return resolve_database_url(os.environ.get(TEST_DATABASE_URL_ENV) or None)
    except ConfigurationError as missing:
        raise ConfigurationError(
            f"the skiplock fixtures need a database: set {TEST_DATABASE_URL_ENV} (or "
            "SKIPLOCK_DATABASE_URL) to a postgresql:// URL, or to 'embedded' for a throwaway "
            f"local server. ({missing})"
        ) from None


@pytest.fixture(scope="session")
def skiplock_schema(skiplock_database_url: str) -> Iterator[str]:
    """A schema of this test session's own, with every migration applied; dropped (with
    everything in it) when the session ends."""
    import psycopg  # noqa: PLC0415 - fixtures import on first use (see the module doc)
    from psycopg import sql  # noqa: PLC0415

    from skiplock.migrate import migrate  # noqa: PLC0415

    name = f"skiplock_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(skiplock_database_url, autocommit=True) as conn:
        migrate(conn, name)
    yield name
    with psycopg.connect(skiplock_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _import_app(path: str) -> App:
    from skiplock.app import App  # noqa: PLC0415
    from skiplock.errors import ConfigurationError  # noqa: PLC0415
    from skiplock.wording import with_article  # noqa: PLC0415

    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(
            f"{APP_SETTING} = {path!r}: write it as module:attribute, e.g. myapp.tasks:app"
        )
    found: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    if not isinstance(found, App):
        raise ConfigurationError(
            f"{APP_SETTING} = {path!r} is {with_article(type(found).__name__)}, not an App"
        )
    return found


@pytest.fixture(scope="session")
def skiplock_app(
    pytestconfig: pytest.Config, skiplock_database_url: str, skiplock_schema: str
) -> App:
    """Your App, pointed at the test database and the session's schema: jobs your code
    enqueues through it in tests go there. Named by the ini setting ``skiplock_app``;
    or override this fixture (and call ``app.configure(database_url=..., schema=...)``)."""
    path = pytestconfig.getini(APP_SETTING)
    if not path:
        from skiplock.errors import ConfigurationError  # noqa: PLC0415

        raise ConfigurationError(
            'the skiplock fixtures need your App: set skiplock_app = "myapp.tasks:app" '
            "under [tool.pytest.ini_options] (or in pytest.ini), or define a fixture "
            "named skiplock_app in your conftest.py that returns it"
        )
    app = _import_app(str(path))
    app.configure(database_url=skiplock_database_url, schema=skiplock_schema)
    return app


@pytest.fixture
def skiplock_conn(skiplock_app: App) -> Iterator[psycopg.Connection[Any]]:
    """A connection to the test database whose transaction rolls back when the test
    ends: enqueue, assert and drain on it, and nothing is left behind. Committing on it
    raises (psycopg refuses a commit inside the test's transaction block)."""
    import psycopg  # noqa: PLC0415

    with (
        psycopg.connect(skiplock_app.database_url) as conn,
        conn.transaction(force_rollback=True),
    ):
        yield conn
