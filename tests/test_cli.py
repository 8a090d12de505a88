"""The ``skiplock`` command, run as a real subprocess (``python -m skiplock``)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import JobFactory, StartWorker, wait_until
from skiplock.migrate import available_migrations
from test_smoke import PASSWORD, CommandLines, with_password

UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=5"


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("SKIPLOCK_DATABASE_URL", "SKIPLOCK_SCHEMA")
    }
    return subprocess.run(
        [sys.executable, "-m", "skiplock", "--database-url", url, *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def refused(result: subprocess.CompletedProcess[str]) -> str:
    """A clean refusal: exit code 2 and a one-line reason, never a traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("skiplock: ")
    return result.stderr


def test_migrate_status_lists_every_migration_as_applied(database_url: str) -> None:
    out = ok(run_cli(database_url, "migrate", "--status"))

    assert out.splitlines() == [
        f"{m.version:04d}_{m.name}  applied" for m in available_migrations()
    ]


def test_migrate_a_fresh_schema_step_by_step(database_url: str, scratch_schema: str) -> None:
    migrations = available_migrations()
    names = [f"{m.version:04d}_{m.name}" for m in migrations]

    status = ok(run_cli(database_url, "--schema", scratch_schema, "migrate", "--status"))
    preview = ok(run_cli(database_url, "--schema", scratch_schema, "migrate", "--sql"))
    first = ok(run_cli(database_url, "--schema", scratch_schema, "migrate", "--target", "1"))
    rest = ok(run_cli(database_url, "--schema", scratch_schema, "migrate"))
    again = ok(run_cli(database_url, "--schema", scratch_schema, "migrate"))

    assert status.splitlines() == [f"{name}  pending" for name in names]
    assert "CREATE TABLE jobs" in preview
    assert f"SET LOCAL search_path TO {scratch_schema};" in preview
    assert first.splitlines()[1:-1] == [f"  applied {names[0]}"]
    assert rest.splitlines()[1:-1] == [f"  applied {name}" for name in names[1:]]
    assert again.strip().endswith(
        f"schema {scratch_schema!r}: up to date, at version "
        f"{migrations[-1].version:04d} (the latest)"
    )
    skiplock.App(database_url, schema=scratch_schema).check_schema()


def test_jobs_list_shows_live_jobs_with_their_last_error(
    app: skiplock.App, make_job: JobFactory
) -> None:
    ready = make_job(task="emails.send", queue="emails")
    dead = make_job(
        task="reports.build",
        state="dead",
        attempts=3,
        errors=[{"attempt": 3, "type": "KeyError", "message": "'region'"}],
    )

    table = ok(run_cli(app.database_url, "jobs", "list")).splitlines()
    only_dead = ok(run_cli(app.database_url, "jobs", "list", "--state", "dead")).splitlines()
    as_json = json.loads(ok(run_cli(app.database_url, "jobs", "list", "--json")))

    assert table[0].split() == ["id", "state", "queue", "attempts", "task", "/", "last", "error"]
    assert table[1].split() == [str(ready), "available", "emails", "0/3", "emails.send"]
    assert table[2].split()[:5] == [str(dead), "dead", "default", "3/3", "reports.build"]
    assert table[2].endswith("[KeyError: 'region']")
    assert [line.split()[0] for line in only_dead[1:]] == [str(dead)]
    assert [(j["id"], j["state"], j["task"]) for j in as_json] == [
        (ready, "available", "emails.send"),
        (dead, "dead", "reports.build"),
    ]


def test_jobs_show_prints_one_job_with_every_error(app: skiplock.App, make_job: JobFactory) -> None:
    errors = [
        {"attempt": 1, "type": "TimeoutError", "message": "first"},
        {"attempt": 2, "type": "TimeoutError", "message": "second"},
    ]
    job_id = make_job(task="sync", args={"account": 9}, state="dead", attempts=2, errors=errors)

    shown = json.loads(ok(run_cli(app.database_url, "jobs", "show", str(job_id), "--json")))

    assert shown["id"] == job_id
    assert shown["state"] == "dead"
    assert shown["args"] == {"account": 9}
    assert shown["errors"] == errors


def test_jobs_show_of_a_missing_job_is_refused(app: skiplock.App) -> None:
    err = refused(run_cli(app.database_url, "jobs", "show", "424242"))

    assert "no job with id 424242" in err


def job_state(conn: psycopg.Connection[Any], job_id: int) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT state, attempts FROM skiplock.jobs WHERE id = %(id)s "
        "UNION ALL SELECT state, attempts FROM skiplock.job_history WHERE id = %(id)s",
        {"id": job_id},
    ).fetchone()


def test_jobs_retry_makes_a_dead_job_available_and_a_worker_runs_it(
    app: skiplock.App,
    make_job: JobFactory,
    autocommit: psycopg.Connection[Any],
    start_worker: StartWorker,
) -> None:
    ran: list[int] = []

    @app.task(name="resend")
    def resend(n: int) -> None:
        ran.append(n)

    job_id = make_job(
        task="resend", args={"n": 5}, state="dead", attempts=3, errors=[{"type": "E"}]
    )
    start_worker(app, poll_interval=0.05)

    out = ok(run_cli(app.database_url, "jobs", "retry", str(job_id)))

    assert f"job {job_id}" in out
    wait_until(lambda: job_state(autocommit, job_id) == ("completed", 1), 15.0, "the retry")
    assert ran == [5]


def test_jobs_cancel_moves_a_waiting_job_to_history(
    app: skiplock.App, make_job: JobFactory, autocommit: psycopg.Connection[Any]
) -> None:
    job_id = make_job(state="scheduled", run_at=datetime(2040, 1, 1, tzinfo=UTC))

    out = ok(run_cli(app.database_url, "jobs", "cancel", str(job_id)))

    assert out.strip() == f"job {job_id} cancelled"
    assert job_state(autocommit, job_id) == ("cancelled", 0)


def test_jobs_retry_all_with_filters_needs_yes_without_a_terminal(
    app: skiplock.App, make_job: JobFactory, autocommit: psycopg.Connection[Any]
) -> None:
    dead_emails = [make_job(queue="emails", state="dead", attempts=3) for _ in range(3)]
    dead_sms = make_job(queue="sms", state="dead", attempts=3)
    waiting = make_job(queue="emails")
    selection = ["jobs", "retry", "--all", "--queue", "emails", "--state", "dead"]

    unconfirmed = refused(run_cli(app.database_url, *selection))
    out = ok(run_cli(app.database_url, *selection, "--yes"))

    assert "--yes" in unconfirmed
    assert "3" in out
    assert [job_state(autocommit, j) for j in dead_emails] == [("available", 0)] * 3
    assert job_state(autocommit, dead_sms) == ("dead", 3)
    assert job_state(autocommit, waiting) == ("available", 0)


def test_jobs_are_listed_shown_and_cancelled_by_tag(app: skiplock.App) -> None:
    @app.task(name="shop.invoice", tags=["billing"])
    def invoice(n: int) -> None: ...

    with app.connect() as conn:
        billed = [int(invoice.enqueue(conn, n=n)) for n in range(2)]
        eu = int(invoice.with_options(tags=["billing", "eu"]).enqueue(conn, n=9))
        plain = int(invoice.with_options(tags=[]).enqueue(conn, n=10))
        conn.commit()

    table = ok(run_cli(app.database_url, "jobs", "list", "--tag", "eu")).splitlines()
    listed = json.loads(ok(run_cli(app.database_url, "jobs", "list", "--tag", "billing", "--json")))
    shown = ok(run_cli(app.database_url, "jobs", "show", str(eu)))
    cancelled = ok(run_cli(app.database_url, "jobs", "cancel", "--all", "--tag", "eu", "--yes"))
    bad = refused(run_cli(app.database_url, "jobs", "list", "--tag", "a b"))

    assert [line.split()[0] for line in table[1:]] == [str(eu)]
    assert table[1].endswith("#billing #eu")
    assert [(j["id"], j["tags"]) for j in listed] == [
        *[(i, ["billing"]) for i in billed],
        (eu, ["billing", "eu"]),
    ]
    assert re.search(r"^  tags:\s+billing, eu$", shown, re.M)
    assert "1" in cancelled
    remaining = json.loads(ok(run_cli(app.database_url, "jobs", "list", "--json")))
    assert sorted(j["id"] for j in remaining) == sorted([*billed, plain])
    assert "tag name 'a b' may only contain" in bad


def running_job(make_job: JobFactory) -> int:
    return make_job(
        state="running",
        attempts=1,
        worker_id=uuid.uuid4(),
        lease_expires_at=datetime(2040, 1, 1, tzinfo=UTC),
    )


def test_a_running_job_is_not_retried(
    app: skiplock.App, make_job: JobFactory, autocommit: psycopg.Connection[Any]
) -> None:
    job_id = running_job(make_job)

    err = refused(run_cli(app.database_url, "jobs", "retry", str(job_id)))

    assert f"job {job_id} is running" in err
    assert job_state(autocommit, job_id) == ("running", 1)


def test_cancelling_a_running_job_asks_its_worker_to_stop_it(
    app: skiplock.App, make_job: JobFactory, autocommit: psycopg.Connection[Any]
) -> None:
    job_id = running_job(make_job)

    ok(run_cli(app.database_url, "jobs", "cancel", str(job_id)))

    # The worker records the cancellation; until then the job is still running.
    assert job_state(autocommit, job_id) == ("running", 1)
    requested = autocommit.execute(
        "SELECT cancel_requested_at IS NOT NULL FROM skiplock.jobs WHERE id = %s", (job_id,)
    ).fetchone()
    assert requested == (True,)


def test_status_json_counts_jobs_per_queue_and_state(
    app: skiplock.App, make_job: JobFactory
) -> None:
    for _ in range(3):
        make_job(queue="emails")
    make_job(queue="emails", state="dead", attempts=3)
    make_job(queue="reports", state="scheduled", run_at=datetime(2040, 1, 1, tzinfo=UTC))
    make_job(
        queue="reports",
        state="running",
        attempts=1,
        worker_id=uuid.uuid4(),
        lease_expires_at=datetime(2040, 1, 1, tzinfo=UTC),
    )

    stats = json.loads(ok(run_cli(app.database_url, "status", "--json")))["queues"]
    text = ok(run_cli(app.database_url, "status")).splitlines()

    counts = {
        row["queue"]: {k: row[k] for k in ("available", "scheduled", "running", "dead")}
        for row in stats
    }
    assert counts == {
        "emails": {"available": 3, "scheduled": 0, "running": 0, "dead": 1},
        "reports": {"available": 0, "scheduled": 1, "running": 1, "dead": 0},
    }
    assert [row["queue"] for row in stats] == ["emails", "reports"]
    assert stats[0]["oldest_ready_seconds"] >= 0
    assert stats[1]["oldest_ready_seconds"] is None
    assert text[0].split()[0] == "queue"
    assert [line.split()[0] for line in text[1:3]] == ["emails", "reports"]


@pytest.mark.parametrize(
    "command",
    [["migrate", "--status"], ["status"], ["jobs", "list"], ["jobs", "retry", "1"]],
)
def test_an_unreachable_database_gives_a_clear_message(command: list[str]) -> None:
    err = refused(run_cli(UNREACHABLE, *command))

    assert "cannot reach the database" in err


@pytest.mark.parametrize("command", [["status"], ["jobs", "list"], ["jobs", "show", "1"]])
def test_an_unmigrated_schema_names_the_command_to_run(
    database_url: str, scratch_schema: str, command: list[str]
) -> None:
    err = refused(run_cli(database_url, "--schema", scratch_schema, *command))

    assert "skiplock migrate" in err


# -- safe defaults -----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
WORKER_APP = "tests.crash_app:app"  # no job is enqueued: its handlers never run


def test_no_database_configured_is_refused_with_how_to_configure_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, "-m", "skiplock", "status"],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )

    err = refused(result)
    assert "no database configured" in err
    assert "SKIPLOCK_DATABASE_URL=embedded" in err


def test_the_url_can_come_from_a_named_environment_variable(app: skiplock.App) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_DATABASE_URL"}
    env["MY_DATABASE_URL"] = app.database_url

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "skiplock", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )

    assert json.loads(ok(run("--database-url-env", "MY_DATABASE_URL", "status", "--json")))
    assert "UNSET_URL is not set" in refused(run("--database-url-env", "UNSET_URL", "status"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listening_addresses(port: int) -> set[str]:
    """Local addresses of TCP sockets listening on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                if len(address) == 8:  # IPv4, little-endian
                    found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
                else:
                    found.add(address)
    return found


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("host_args", "bound"), [([], "127.0.0.1"), (["--metrics-host", "0.0.0.0"], "0.0.0.0")]
)
def test_metrics_listen_on_this_machine_only_unless_told(
    app: skiplock.App, host_args: list[str], bound: str
) -> None:
    port = free_port()
    env = {**os.environ, "SKIPLOCK_DATABASE_URL": app.database_url}
    command = [sys.executable, "-m", "skiplock", "worker", WORKER_APP, "--queues", "crash"]
    command += ["--metrics-port", str(port), *host_args]
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as worker:
        try:
            wait_until(
                lambda: listening_addresses(port) or worker.poll() is not None,
                timeout=30,
                what="the metrics port to listen",
            )
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
            assert listening_addresses(port) == {bound}

            def page() -> bytes:
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=10) as response:
                    return bytes(response.read())

            # The queue gauges come from the leader only: the worker exports them once it
            # has been elected (its first pass), not necessarily by its first scrape.
            wait_until(
                lambda: b"skiplock_queue_jobs" in page(), timeout=30, what="the queue gauges"
            )
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=30)


@pytest.mark.timeout(90)
def test_worker_processes_keep_the_password_off_their_command_lines(
    app: skiplock.App, autocommit: psycopg.Connection[Any]
) -> None:
    """--processes starts children; the URL (with a password the server ignores: trust
    authentication) reaches them through their environment only."""
    url = with_password(app.database_url)
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_DATABASE_URL"}
    command = [sys.executable, "-m", "skiplock", "--database-url", url, "worker", WORKER_APP]
    command += ["--queues", "crash", "--processes", "2", "--poll-interval", "0.1"]
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as parent:
        lines = CommandLines(parent.pid)
        lines.start()
        try:

            def registered() -> int:
                row = autocommit.execute("SELECT count(*) FROM skiplock.workers").fetchone()
                return 0 if row is None else int(row[0])

            # Both children connected: the URL reached them.
            wait_until(lambda: registered() == 2, timeout=60, what="two worker processes")
        finally:
            lines.stop()
            parent.send_signal(signal.SIGTERM)
            parent.wait(timeout=60)

    assert len(lines.holding(WORKER_APP)) == 2, lines.seen
    assert lines.holding(PASSWORD) == []
