"""A password never shows in an error about its URL: neither in the URL as quoted, nor in
libpq's (or psycopg's) reason, which quotes the token it stopped at. Generated passwords
hold raw ``%``, ``@``, ``/`` and spaces; each case below gives libpq's real error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from starlette.testclient import TestClient

from skiplock import routing
from skiplock.dashboard import create_app
from skiplock.errors import ConfigurationError
from skiplock.routing import database_url_problem

PASSWORDS = ["Kq%Zx9wV", "Kq Zx9wV", "Kq/Zx%9wV", "Kq%zzW@v J", "Kq9Zx%", "Kq%4"]

# (URL, its password) malformed so that libpq refuses to parse it.
MALFORMED = [
    *((f"postgresql://bob:{pw}@127.0.0.1:5432/postgres", pw) for pw in PASSWORDS),
    ("postgresql://bob@127.0.0.1/postgres?password=Kq%Zx9wV", "Kq%Zx9wV"),
    ("postgresql://bob:Kq%Zx9wV@[::1/postgres", "Kq%Zx9wV"),
    ("host=127.0.0.1 user=bob password=Kq%Zx 9wV", "Kq%Zx 9wV"),
    ("host=127.0.0.1 user=bob password='Kq%Zx9wV", "Kq%Zx9wV"),
]
# A raw @ parses: libpq ends the password at the first @ and takes the rest for the host,
# which the connection attempt then quotes.
UNRESOLVABLE = ("postgresql://bob:Kq9@Zx9wV@127.0.0.1:5432/postgres", "Kq9@Zx9wV")


def leaks(password: str, text: str) -> list[str]:
    """Every 3 characters in a row of ``password`` that ``text`` shows."""
    return [password[i : i + 3] for i in range(len(password) - 2) if password[i : i + 3] in text]


def libpq_error(url: str) -> str:
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        return str(exc)
    raise AssertionError(f"{url!r} parses")


@pytest.mark.parametrize(("url", "password"), MALFORMED)
def test_libpq_quotes_the_password_and_without_passwords_masks_it(url: str, password: str) -> None:
    error = libpq_error(url)

    assert leaks(password, error + url)  # what would show unmasked
    assert leaks(password, routing.without_passwords(error, url)) == []
    assert leaks(password, routing.without_passwords(url, url)) == []


@pytest.mark.parametrize(("url", "password"), MALFORMED)
def test_a_malformed_route_is_named_without_its_password(url: str, password: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        routing.check_routes({"reports": url})

    assert "queue_databases['reports']: the database URL" in str(refused.value)
    assert "is malformed (" in str(refused.value)
    assert leaks(password, str(refused.value)) == []


@pytest.mark.parametrize(("url", "password"), MALFORMED)
def test_the_cli_names_a_malformed_url_without_its_password(url: str, password: str) -> None:
    problem = database_url_problem(url)

    assert problem is not None and "is malformed (" in problem
    assert leaks(password, problem) == []


def test_a_well_formed_url_keeps_everything_but_its_password() -> None:
    url = "postgresql://bob:Kq9Zx9wV@db.example:5432/shop?application_name=a@b"

    assert routing.without_passwords(url, url) == (
        "postgresql://bob:***@db.example:5432/shop?application_name=a@b"
    )
    assert routing.without_passwords(
        "postgresql://db:5432/shop?x=a@b", "postgresql://db:5432/shop?x=a@b"
    ) == ("postgresql://db:5432/shop?x=a@b")
    assert routing.without_passwords(
        "host=db password='a b' user=x", "host=db password='a b' user=x"
    ) == ("host=db password=*** user=x")


def skiplock(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
    return subprocess.run(
        [sys.executable, "-m", "skiplock", *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=60,
        env={**clean, **(env or {})},
        check=False,
    )


def one_line_refusal(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("skiplock: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize(("url", "password"), MALFORMED)
@pytest.mark.parametrize("given", ["--database-url", "$SKIPLOCK_DATABASE_URL", "--read-url"])
def test_the_command_refuses_a_malformed_url_without_its_password(
    database_url: str, url: str, password: str, given: str
) -> None:
    if given == "--database-url":
        result = skiplock("--database-url", url, "status")
    elif given == "--read-url":
        result = skiplock("--database-url", database_url, "--read-url", url, "status")
    else:
        result = skiplock("status", env={"SKIPLOCK_DATABASE_URL": url})

    err = one_line_refusal(result)
    assert f"skiplock: {given}: the database URL " in err
    assert leaks(password, err) == []


def test_the_command_names_an_unreachable_host_without_the_passwords_tail() -> None:
    url, password = UNRESOLVABLE

    err = one_line_refusal(skiplock("--database-url", url, "status"))

    assert err.startswith("skiplock: cannot reach the database: ")
    assert leaks(password, err) == []


@pytest.mark.parametrize(("url", "password"), MALFORMED)
def test_the_dashboard_refuses_a_malformed_url_without_its_password(
    url: str, password: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        create_app(url, "skiplock")

    assert "is malformed (" in str(refused.value)
    assert leaks(password, str(refused.value)) == []


def test_the_dashboards_error_page_names_an_unreachable_host_without_the_passwords_tail() -> None:
    url, password = UNRESOLVABLE

    with TestClient(
        create_app(url, "skiplock"), base_url="http://localhost", raise_server_exceptions=False
    ) as web:
        page = web.get("/")

    assert "cannot reach the database" in page.text
    assert leaks(password, page.text) == []


def test_a_worker_logs_an_unreachable_host_without_the_passwords_tail() -> None:
    """The worker retries an unreachable database, logging why each time."""
    url, password = UNRESOLVABLE
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
    command = [sys.executable, "-m", "skiplock", "--database-url", url, "worker"]
    with subprocess.Popen(
        [*command, "tests.crash_app:app"],
        cwd=Path(__file__).resolve().parent.parent,
        env=clean,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        assert worker.stderr is not None
        try:
            lines = [worker.stderr.readline() for _ in range(2)]
        finally:
            worker.kill()

    assert "cannot reach the database" in lines[1]
    assert leaks(password, "".join(lines)) == []
