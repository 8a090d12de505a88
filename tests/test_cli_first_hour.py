"""What a newcomer trips on in the first hour (issue 25, items 4 to 6): a mistyped option or
command gets the one meant, a global option works after the command too, an App that is
not where the command looks says where it is, a pipe closed early ends quietly, errors
stay one line, counts read as English, and ``App(url)`` refuses a URL that cannot work
when it is built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import skiplock
from skiplock import cli
from skiplock.wording import plural, with_article

ROOT = Path(__file__).resolve().parent.parent


def cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``skiplock ARGV`` in this process: its exit status and what it printed to stderr."""
    capsys.readouterr()
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


# -- the parser suggests ----------------------------------------------------------------------


def test_a_mistyped_option_gets_the_one_meant(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(capsys, "worker", "myapp.tasks:app", "--concurency", "4")

    assert code == 2
    assert err == (
        "skiplock: unrecognized arguments: --concurency 4; did you mean --concurrency? "
        "(see `skiplock --help`)\n"
    )


def test_an_option_far_from_every_known_one_gets_no_guess(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = cli_error(capsys, "status", "--frobnicate")

    assert code == 2
    assert err == "skiplock: unrecognized arguments: --frobnicate (see `skiplock --help`)\n"


def test_a_mistyped_command_gets_the_one_meant(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(capsys, "statsu")
    assert code == 2
    assert err.startswith("skiplock: unknown command 'statsu'; did you mean 'status'? choose from ")

    code, err = cli_error(capsys, "jobs", "lst")
    assert err == (
        "skiplock: unknown command 'lst'; did you mean 'list'? choose from list, show, "
        "retry, cancel, delete (see `skiplock jobs --help`)\n"
    )


def test_a_mistyped_choice_gets_the_one_meant(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(capsys, "jobs", "list", "--state", "deda")

    assert code == 2
    assert err.startswith("skiplock: --state: unknown value 'deda'; did you mean 'dead'? ")


# -- global options in either place -----------------------------------------------------------


def test_global_options_work_after_the_command(
    app: skiplock.App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.migrate()
    before = cli.main(["--database-url", app.database_url, "--schema", app.schema, "status"])
    out_before = capsys.readouterr().out

    after = cli.main(["status", "--schema", app.schema, "--database-url", app.database_url])
    out_after = capsys.readouterr().out

    assert (before, after) == (0, 0)
    assert out_after.splitlines()[1:] == out_before.splitlines()[1:]  # the first is a clock
    args = cli.build_parser().parse_args(["-v", "--schema", "a", "jobs", "list"])
    assert (args.schema, args.verbose, args.database_url) == ("a", 1, None)
    args = cli.build_parser().parse_args(["--schema", "a", "jobs", "list", "--schema", "b"])
    assert args.schema == "b"  # the nearer one wins


def test_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out == f"skiplock {skiplock.__version__}\n"


# -- finding the App --------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory holding package ``shop_first_hour`` with an App ``app`` in ``tasks``,
    made the current directory (the worker imports from there)."""
    package = tmp_path / "shop_first_hour"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tasks.py").write_text(
        textwrap.dedent(
            """
            import skiplock

            app = skiplock.App("postgresql://nobody@127.0.0.1:1/none")
            settings = {"debug": True}
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("shop_first_hour")]:
        del sys.modules[name]


def test_a_missing_attribute_names_the_app_nearby(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli_error(capsys, "worker", "shop_first_hour.tasks:ap")

    assert code == 2
    assert err == (
        "skiplock: module 'shop_first_hour.tasks' has no attribute 'ap'; "
        "did you mean shop_first_hour.tasks:app?\n"
    )


def test_an_attribute_that_is_not_an_app_says_what_it_is(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli_error(capsys, "worker", "shop_first_hour.tasks:settings")

    assert (code, err) == (
        2,
        "skiplock: 'shop_first_hour.tasks:settings' is a dict, not a skiplock.App\n",
    )


def test_a_file_path_gets_the_dotted_module(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli_error(capsys, "worker", "shop_first_hour/tasks.py:app")

    assert (code, err) == (
        2,
        "skiplock: 'shop_first_hour/tasks.py:app' names a file; name the module, with dots: "
        "shop_first_hour.tasks:app\n",
    )


# -- output -----------------------------------------------------------------------------------


def test_a_pipe_closed_early_ends_quietly(app: skiplock.App) -> None:
    app.migrate()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")},
        "SKIPLOCK_DATABASE_URL": app.database_url,
        "SKIPLOCK_SCHEMA": app.schema,
    }
    # About 48 bytes a row: 5,000 rows are far more than a pipe's 64 KiB buffer, so the
    # writer is still writing when the reader leaves, however the two are scheduled.
    with app.connect() as conn:
        conn.execute(
            f'INSERT INTO "{app.schema}".jobs (task, args)'
            " SELECT 't' || n, '{}' FROM generate_series(1, 5000) AS n"
        )
    # `skiplock jobs list --limit 5000 | head -1`: the reader leaves after one line.
    shown = subprocess.Popen(
        [sys.executable, "-m", "skiplock", "jobs", "list", "--limit", "5000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert shown.stdout is not None and shown.stderr is not None
    shown.stdout.readline()
    shown.stdout.close()
    err = shown.stderr.read().decode()
    assert shown.wait(timeout=60) == 1
    assert "BrokenPipeError" not in err and "Traceback" not in err, err


def test_a_sql_error_is_one_line(app: skiplock.App, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(
        capsys, "--database-url", app.database_url, "--schema", "no_such_schema_x", "status"
    )

    assert code == 2
    assert err.count("\n") == 1, err
    assert "run `skiplock migrate` first" in err


def test_counts_and_type_names_read_as_english() -> None:
    assert [plural(n, "dead job") for n in (0, 1, 2)] == [
        "0 dead jobs",
        "1 dead job",
        "2 dead jobs",
    ]
    assert [with_article(t) for t in ("object", "dict", "Event", "int")] == [
        "an object",
        "a dict",
        "an Event",
        "an int",
    ]


def test_an_argument_that_is_not_json_says_an_object() -> None:
    app = skiplock.App("postgresql://nobody@127.0.0.1:1/none", schema="first_hour")

    @app.task(name="noop")
    def noop(value: Any) -> None:
        pass

    with pytest.raises(skiplock.EnqueueError, match="argument 'value' is an object, which"):
        noop.job(value=object())


# -- App(url) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("mysql://root@db/shop", "starts with mysql://, and skiplock needs PostgreSQL"),
        ("localhost:5432/shop", "neither a URL nor key=value settings"),
        ("", "expected postgresql://USER@HOST:PORT/DBNAME (or key=value settings), got ''"),
    ],
)
def test_an_app_refuses_a_url_that_cannot_work_when_it_is_built(url: str, problem: str) -> None:
    with pytest.raises(skiplock.ConfigurationError) as refused:
        skiplock.App(url)

    message = str(refused.value)
    assert message.startswith("App(database_url=...): ")
    assert problem in message


def test_an_app_keeps_a_password_out_of_its_refusal() -> None:
    with pytest.raises(skiplock.ConfigurationError) as refused:
        skiplock.App("postgresql://app:s3cret@db/shop?sslmod=require")

    assert "s3cret" not in str(refused.value)
    assert 'invalid URI query parameter: "sslmod"' in str(refused.value)


def test_a_worker_that_cannot_reach_its_database_warns_in_one_line_and_keeps_trying() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
    command = [sys.executable, "-m", "skiplock", "--database-url", "postgresql://u@127.0.0.1:1/x"]
    with subprocess.Popen(
        [*command, "worker", "tests.crash_app:app"],
        cwd=ROOT,
        env=clean,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        assert worker.stderr is not None
        lines: list[str] = []
        said: list[str] = []
        try:
            # The second try comes within about a second (back-off from 0.5 s); a worker
            # that stopped trying would end its stderr here instead.
            for line in worker.stderr:
                lines.append(line)
                if "reach the database" in line:
                    said.append(line)
                if len(said) == 2:
                    break
        finally:
            worker.kill()

    first, second = said
    assert " WARNING skiplock.worker: cannot reach the database (" in first
    assert first.rstrip().endswith("retrying until it answers, at most 15s apart (Ctrl-C stops)")
    assert " WARNING skiplock.worker: still cannot reach the database after 2 tries (" in second
    # One line a message: libpq's own further lines (Is the server running ...) left out.
    assert all(line[:2] == "20" for line in lines), lines
