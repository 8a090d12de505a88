"""The first hour (issue 13, section 4), tried as a new user would: a mistyped URL, an
enqueue before ``skiplock migrate``, a misspelled keyword, the embedded server, and the
README's own tutorial. Each ends in a message that names the fix."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import skiplock
from skiplock.routing import database_url_problem, without_password
from skiplock.tasks import argument_mismatch

README = Path(__file__).resolve().parent.parent / "README.md"


def skiplock_command(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
    return subprocess.run(
        [sys.executable, "-m", "skiplock", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
        cwd=cwd,
        check=False,
    )


def one_line_refusal(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("skiplock: ")
    assert result.stderr.count("\n") == 1
    return result.stderr


# -- a malformed URL -------------------------------------------------------------------


def test_a_url_missing_its_colon_is_refused_in_one_line() -> None:
    err = one_line_refusal(skiplock_command("--database-url", "postgres//host/db", "status"))

    assert err == (
        "skiplock: --database-url: the database URL 'postgres//host/db' is malformed "
        "(neither a URL nor key=value settings); expected "
        "postgresql://USER@HOST:PORT/DBNAME (or key=value settings)\n"
    )


def test_a_url_of_another_database_is_refused_without_its_password() -> None:
    err = one_line_refusal(
        skiplock_command("migrate", env={"SKIPLOCK_DATABASE_URL": "mysql://app:s3cret@db/shop"})
    )

    assert err.startswith(
        "skiplock: $SKIPLOCK_DATABASE_URL: the database URL starts with mysql://, and "
        "skiplock needs PostgreSQL"
    )
    assert "s3cret" not in err


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://u@h:5432/db", None),
        ("postgres://u:pw@h/db?sslmode=require", None),
        ("host=h dbname=db user=u", None),
        ("embedded", None),
        ("postgresql://u:pw@h/db?sslmod=require", "invalid URI query parameter"),
        ("host=h colour=red", 'invalid connection option "colour"'),
        ("sqlite:///tmp/x.db", "starts with sqlite://"),
    ],
)
def test_database_url_problem(url: str, problem: str | None) -> None:
    found = database_url_problem(url)

    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
        assert "pw" not in found


def test_without_password() -> None:
    assert without_password("postgresql://app:s3cret@db:5432/shop") == (
        "postgresql://app:***@db:5432/shop"
    )
    assert without_password("host=db password=s3cret user=app") == ("host=db password=*** user=app")
    assert without_password("postgresql://app@db/shop") == "postgresql://app@db/shop"


# -- enqueue before migrate ------------------------------------------------------------


@pytest.fixture
def unmigrated_app(database_url: str) -> Iterator[skiplock.App]:
    schema = "never_migrated"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    yield skiplock.App(database_url, schema=schema)


def test_enqueue_before_migrate_names_the_command(unmigrated_app: skiplock.App) -> None:
    @unmigrated_app.task(name="send_receipt")
    def send_receipt(order_id: int) -> None: ...

    with psycopg.connect(unmigrated_app.database_url) as conn:
        with pytest.raises(skiplock.SchemaNotReadyError) as one:
            send_receipt.enqueue(conn, order_id=1)
        conn.rollback()
        with pytest.raises(skiplock.SchemaNotReadyError) as many:
            unmigrated_app.enqueue_many(conn, [send_receipt.job(order_id=2)])

    for caught in (one, many):
        message = str(caught.value)
        assert message.endswith("run `skiplock migrate` first")
        assert "'never_migrated'" in message
        assert isinstance(
            caught.value.__cause__, psycopg.errors.UndefinedTable | psycopg.errors.InvalidSchemaName
        )


def test_enqueue_async_before_migrate_names_the_command(unmigrated_app: skiplock.App) -> None:
    @unmigrated_app.task(name="send_receipt")
    def send_receipt(order_id: int) -> None: ...

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(unmigrated_app.database_url) as conn:
            with pytest.raises(skiplock.SchemaNotReadyError, match="skiplock migrate"):
                await send_receipt.enqueue_async(conn, order_id=1)
            await conn.rollback()
            with pytest.raises(skiplock.SchemaNotReadyError, match="skiplock migrate"):
                await unmigrated_app.enqueue_many_async(conn, [send_receipt.job(order_id=2)])

    asyncio.run(scenario())


# -- a misspelled keyword --------------------------------------------------------------


def test_a_misspelled_keyword_is_named_with_the_one_it_misses() -> None:
    app = skiplock.App("postgresql://nowhere/none")

    @app.task(name="send_receipt")
    def send_receipt(order_id: int, copies: int = 1) -> None: ...

    with pytest.raises(skiplock.EnqueueError) as caught:
        send_receipt.job(orderid=1)

    assert str(caught.value) == (
        "cannot enqueue send_receipt: unexpected keyword argument 'orderid' "
        "(did you mean 'order_id'?); missing a required argument: 'order_id'"
    )


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            {"order_id", "colour"},
            "unexpected keyword argument 'colour'",
        ),
        (
            {"copeis", "order_id"},
            "unexpected keyword argument 'copeis' (did you mean 'copies'?)",
        ),
        (
            set(),
            "missing a required argument: 'order_id'",
        ),
        (
            {"x"},
            "unexpected keyword argument 'x'; missing a required argument: 'order_id'",
        ),
    ],
)
def test_argument_mismatch(given: set[str], expected: str) -> None:
    accepted = {"order_id", "copies"}

    assert argument_mismatch(given, accepted, {"order_id"}) == expected


def test_argument_mismatch_names_every_missing_argument_and_ignores_extras_for_kwargs() -> None:
    assert argument_mismatch({"z"}, {"a", "b"}, {"a", "b"}, takes_any=True) == (
        "missing required arguments: 'a', 'b'"
    )


# -- the embedded server ---------------------------------------------------------------


def test_embedded_status_and_stop_of_a_server_not_running(tmp_path: Path) -> None:
    env = {"SKIPLOCK_EMBEDDED_DIR": str(tmp_path / "postgres-18")}

    status = skiplock_command("embedded", "status", env=env)
    stop = skiplock_command("embedded", "stop", env=env)

    assert (status.returncode, status.stdout) == (
        1,
        f"not running (data directory {tmp_path / 'postgres-18'})\n",
    )
    assert (stop.returncode, stop.stdout) == (0, status.stdout)
    assert not (tmp_path / "postgres-18").exists()  # neither started one


@pytest.mark.server_version  # so that the embedded half, where it runs, selects it
@pytest.mark.skipif(
    bool(os.environ.get("SKIPLOCK_TEST_DSN")),
    reason="starts a PostgreSQL 18 of its own: runs with the embedded half of the suite",
)
def test_embedded_url_status_stop() -> None:
    # Under /tmp, not pytest's tmp_path: as root the server runs as another user, which
    # must traverse every parent of its data directory.
    parent = Path(tempfile.mkdtemp(prefix="skiplock-embedded-", dir="/tmp"))
    data = parent / "postgres-18"
    env = {"SKIPLOCK_EMBEDDED_DIR": str(data)}
    try:
        url = skiplock_command("embedded", "url", env=env)
        assert url.returncode == 0, url.stderr
        with psycopg.connect(url.stdout.strip()) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)

        status = skiplock_command("embedded", "status", env=env)
        assert status.returncode == 0
        assert status.stdout.startswith("running, pid ")
        assert f"url: {url.stdout.strip()}" in status.stdout.splitlines()

        stop = skiplock_command("embedded", "stop", env=env)
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout.startswith(f"stopped the server of {data} (pid ")
        assert skiplock_command("embedded", "status", env=env).returncode == 1
    finally:
        skiplock_command("embedded", "stop", env=env)
        shutil.rmtree(parent, ignore_errors=True)


# -- the README ------------------------------------------------------------------------


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_sets_up_in_a_virtual_environment() -> None:
    setup = readme_blocks("sh")[0]

    assert setup.splitlines()[0].startswith("python3 -m venv .venv && . .venv/bin/activate")
    assert "externally-managed-environment" in README.read_text()
