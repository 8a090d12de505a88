"""The pytest plugin in suites of its own (pytest in a subprocess): it leaves a suite that
does not use it alone, says what to set when its App is not named, and gives a suite
that names it a migrated throwaway schema, dropped at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg


def run_pytest(
    directory: Path, files: dict[str, str], **env: str
) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith("SKIPLOCK_")
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=directory,
        env={**environment, **env, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_suite_that_does_not_use_it_is_left_alone(tmp_path: Path) -> None:
    ran = run_pytest(
        tmp_path,
        {
            "test_theirs.py": """
                import sys

                import pytest


                @pytest.fixture
                def conn():
                    return "their own"


                def test_their_fixture_wins(conn):
                    assert conn == "their own"


                def test_the_plugin_is_loaded_and_idle(pytestconfig):
                    assert pytestconfig.pluginmanager.has_plugin("skiplock")
                    assert "skiplock.testing" not in sys.modules  # imported on first use


                def test_its_fixture_says_what_to_set(request):
                    with pytest.raises(Exception, match="set SKIPLOCK_TEST_DATABASE_URL"):
                        request.getfixturevalue("skiplock_database_url")
            """
        },
    )  # and no database is configured: nothing may try to connect

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "3 passed" in ran.stdout


def test_fixtures_without_an_app_say_what_to_set(tmp_path: Path, database_url: str) -> None:
    ran = run_pytest(
        tmp_path,
        {"test_mine.py": "def test_it(skiplock_conn):\n    pass\n"},
        SKIPLOCK_TEST_DATABASE_URL=database_url,
    )

    assert ran.returncode == 1
    assert 'set skiplock_app = "myapp.tasks:app" under [tool.pytest.ini_options]' in ran.stdout


def throwaway_schemas(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'skiplock\\_test\\_%'"
        ).fetchall()
    return {row[0] for row in rows}


def test_a_suite_that_names_its_app_gets_a_schema_of_its_own(
    tmp_path: Path, database_url: str
) -> None:
    before = throwaway_schemas(database_url)
    ran = run_pytest(
        tmp_path,
        {
            "pytest.ini": """
                [pytest]
                skiplock_app = shopapp:app
                pythonpath = .
            """,
            "shopapp.py": """
                import skiplock

                app = skiplock.App()


                @app.task(queue="emails")
                def send_receipt(order_id: int) -> str:
                    return f"receipt {order_id}"
            """,
            "test_shop.py": """
                from skiplock.testing import assert_enqueued, drain

                from shopapp import app, send_receipt


                def test_enqueue_and_drain(skiplock_conn, skiplock_schema):
                    assert app.schema == skiplock_schema
                    send_receipt.enqueue(skiplock_conn, order_id=1)
                    assert_enqueued(skiplock_conn, send_receipt, args={"order_id": 1})
                    [outcome] = drain(skiplock_conn, app)
                    assert outcome.result == "receipt 1"


                def test_the_last_tests_job_rolled_back(skiplock_conn):
                    assert drain(skiplock_conn, app) == []
            """,
        },
        SKIPLOCK_TEST_DATABASE_URL=database_url,
    )

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "2 passed" in ran.stdout
    assert throwaway_schemas(database_url) == before  # dropped at the end
