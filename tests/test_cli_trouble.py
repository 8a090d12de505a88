"""A CLI that shows trouble (issue 13, section 4): each command, tried as an operator
would, says when work is stuck and reads well. Real PostgreSQL, the CLI run in process
(the worker as a real process where its start-up matters)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import JobFactory, StartWorker, wait_until
from skiplock import cli, client, doctor
from skiplock.cli.jobs import job_view
from skiplock.cli.worker import worker_queues
from skiplock.sql import maintenance, render
from skiplock.tracebacks import format_handler_exception, is_internal
from skiplock.types import Job, JobState
from skiplock.wording import plural


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def run(app: skiplock.App, capsys: pytest.CaptureFixture[str]) -> Any:
    """``skiplock --database-url URL ARGS...`` in this process, on ``app``'s schema."""

    def call(*args: str) -> Result:
        capsys.readouterr()
        code = cli.main(["--database-url", app.database_url, "--schema", app.schema, *args])
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        return Result(code, captured.out, captured.err)

    return call


def pause(app: skiplock.App, queue: str) -> None:
    with app.connect(autocommit=True) as conn:
        client.set_queue_paused(conn, app.schema, queue, paused=True)


def register_dead_worker(app: skiplock.App, queues: list[str]) -> uuid.UUID:
    """A registration a SIGKILLed worker leaves behind: seen just now, but no session
    holds its liveness lock."""
    worker_id = uuid.uuid4()
    with app.connect(autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (id, host, pid, queues, concurrency) VALUES (%s, 'gone', 1, %s, 1)"
            ).format(sql.Identifier(app.schema, "workers")),
            (worker_id, queues),
        )
    return worker_id


# -- status ----------------------------------------------------------------------------


def test_status_marks_a_paused_queue_holding_ready_jobs(
    app: skiplock.App, make_job: JobFactory, run: Any
) -> None:
    make_job(queue="emails")
    make_job(queue="emails")
    pause(app, "emails")

    shown = run("status")
    as_json = json.loads(run("status", "--json").out)

    assert shown.code == 0
    emails = next(line for line in shown.out.splitlines() if line.startswith("emails"))
    assert emails.endswith("  paused")
    assert (
        "note: queue emails is paused with 2 ready jobs waiting: "
        "`skiplock queues resume emails`" in shown.out.splitlines()
    )
    assert as_json["queues"][0]["paused"] is True
    assert as_json["notes"] == [
        "queue emails is paused with 2 ready jobs waiting: `skiplock queues resume emails`"
    ]


def test_status_says_1_worker_and_notes_a_queue_it_does_not_serve(
    app: skiplock.App, make_job: JobFactory, start_worker: StartWorker, run: Any
) -> None:
    make_job(queue="reports")
    start_worker(app, queues=["emails"])

    lines = run("status").out.splitlines()

    assert "1 worker" in lines
    assert (
        "note: queue reports has 1 ready job waiting and no worker serves it "
        "(start one with --queues reports)" in lines
    )


def test_status_notes_ready_jobs_with_no_worker_at_all(
    app: skiplock.App, make_job: JobFactory, run: Any
) -> None:
    make_job(queue="default")

    lines = run("status").out.splitlines()

    assert "note: queue default has 1 ready job waiting and no worker is running" in lines
    assert "0 workers" in lines


def test_status_ignores_a_null_queue_in_a_hand_written_worker_row(
    app: skiplock.App, make_job: JobFactory, run: Any
) -> None:
    make_job(queue="emails")
    register_dead_worker(app, ["emails", None])  # type: ignore[list-item]

    result = run("status", "--json")

    assert result.code == 0
    queues = [q["queue"] for q in json.loads(result.out)["queues"]]
    assert queues == ["emails"]


def test_plural() -> None:
    assert [plural(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]


# -- doctor ----------------------------------------------------------------------------


def findings(app: skiplock.App, check: str) -> list[doctor.Finding]:
    with app.connect(autocommit=True) as conn:
        return [f for f in doctor.run(conn, app.schema) if f.check == check]


def test_doctor_fails_on_ready_jobs_with_no_worker_alive(
    app: skiplock.App, make_job: JobFactory, run: Any
) -> None:
    make_job(queue="default")
    register_dead_worker(app, ["default"])  # registered, but its sessions are gone

    result = run("doctor")

    assert result.code == 1
    assert "[FAIL] waiting jobs: queue default has 1 ready job and no worker is alive" in (
        result.out
    )
    assert "fix: start one: skiplock worker MODULE:APP" in result.out


def test_doctor_warns_about_a_paused_queue_holding_ready_jobs(
    app: skiplock.App, make_job: JobFactory
) -> None:
    make_job(queue="emails")
    make_job(queue="emails")
    pause(app, "emails")

    assert findings(app, "waiting jobs") == [
        doctor.Finding(
            "waiting jobs",
            "warn",
            "queue emails is paused with 2 ready jobs",
            "skiplock queues resume emails (unless it is paused on purpose)",
        )
    ]


def test_doctor_counts_a_listening_worker_and_sees_what_it_does_not_serve(
    app: skiplock.App, make_job: JobFactory, start_worker: StartWorker
) -> None:
    make_job(queue="reports")
    start_worker(app, queues=["emails"])

    (notifications,) = findings(app, "notifications")
    (waiting,) = findings(app, "waiting jobs")

    assert notifications.level == "ok"
    assert notifications.message.endswith(", 1 listening session")
    assert waiting.level == "fail"
    assert (
        waiting.message == "queue reports has 1 ready job and none of the 1 live worker serves it"
    )
    assert waiting.fix.startswith("start a worker with --queues reports")


def test_doctor_takes_a_worker_for_alive_while_its_liveness_lock_is_held(
    app: skiplock.App, make_job: JobFactory
) -> None:
    make_job(queue="default")
    worker_id = register_dead_worker(app, ["default"])
    with app.connect(autocommit=True) as session:
        session.execute("SELECT pg_advisory_lock(42)")  # another advisory lock: no sign of life
        assert [f.level for f in findings(app, "waiting jobs")] == ["fail"]

        # What each of a worker's sessions does when it connects (worker/liveness.py).
        session.execute(render(maintenance.WORKER_LOCK, app.schema), {"id": worker_id})
        alive = findings(app, "waiting jobs")

    assert alive == [doctor.Finding("waiting jobs", "ok", "every queue with ready jobs is served")]
    assert [f.level for f in findings(app, "waiting jobs")] == ["fail"]  # session closed


# -- the worker's queues ---------------------------------------------------------------


def make_app() -> skiplock.App:
    app = skiplock.App("postgresql://nowhere/none")

    @app.task(name="send", queue="emails")
    def send(order_id: int) -> None: ...

    @app.task(name="build", queue="reports")
    def build() -> None: ...

    @app.task(name="ping")
    def ping() -> None: ...

    return app


def test_worker_queues_default_to_the_registered_tasks_queues() -> None:
    app = make_app()

    assert worker_queues(None, app) == (["default", "emails", "reports"], {})
    assert worker_queues(None, skiplock.App("postgresql://nowhere/none")) == (["default"], {})


def test_worker_queues_given_name_the_tasks_they_leave_out() -> None:
    queues, unserved = worker_queues(" emails, extra ", make_app())

    assert queues == ["emails", "extra"]
    assert unserved == {
        "default": ["ping"],
        "reports": ["build"],
    }


WORKER_APP = """
import skiplock

app = skiplock.App()


@app.task(queue="emails")
def send(order_id: int) -> int:
    return order_id
"""


@pytest.fixture
def worker_process(app: skiplock.App, tmp_path: Path) -> Iterator[Any]:
    (tmp_path / "shopapp.py").write_text(textwrap.dedent(WORKER_APP))
    started: list[subprocess.Popen[str]] = []

    def start(*options: str) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "skiplock", "--database-url", app.database_url),
                *("--schema", app.schema, "worker", "shopapp:app", *options),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


def stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    return out


def test_a_worker_without_queues_runs_its_tasks_of_other_queues(
    app: skiplock.App, make_job: JobFactory, worker_process: Any
) -> None:
    make_job(task="shopapp.send", args={"order_id": 7}, queue="emails")
    process = worker_process()

    def finished() -> bool:
        with app.connect(autocommit=True) as conn:
            return conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE state = 'completed'").format(
                    sql.Identifier(app.schema, "job_history")
                )
            ).fetchone() == (1,)

    wait_until(finished, 30, "the emails job to complete")
    out = stop(process)

    assert "serving the queues of the registered tasks: emails" in out


def test_a_worker_given_other_queues_says_which_tasks_it_leaves_out(
    app: skiplock.App, worker_process: Any
) -> None:
    process = worker_process("--queues", "default")
    with app.connect(autocommit=True) as conn:
        wait_until(
            lambda: (
                conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(app.schema, "workers"))
                ).fetchone()
                == (1,)
            ),
            30,
            "the worker to register",
        )
    out = stop(process)

    assert (
        "not serving queue 'emails' (tasks shopapp.send): --queues leaves it out, so its "
        "jobs wait for another worker" in out
    )


def test_worker_help_describes_every_option_with_its_default() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    worker = sub.choices["worker"]

    # The global options it takes too are described on the top level's help.
    options = [
        a
        for a in worker._actions
        if a.option_strings and a.dest != "help" and a.default is not argparse.SUPPRESS
    ]

    assert {"--concurrency", "--lease", "--queues", "--tcp-user-timeout"} <= {
        name for action in options for name in action.option_strings
    }
    for action in options:
        assert action.help, action.dest
        assert "default" in action.help, action.dest
    rendered = worker.format_help()
    assert "(default: 10)" in rendered  # --concurrency
    assert "(default: 30)" in rendered  # --lease, --shutdown-timeout


# -- jobs show -------------------------------------------------------------------------

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/shop/tasks.py", line 6, in send\n'
    "    raise ValueError(order_id)\n"
    "ValueError: 7\n"
)


def test_jobs_show_is_readable_and_json_is_raw(
    app: skiplock.App, make_job: JobFactory, run: Any
) -> None:
    errors = [
        {
            "attempt": 1,
            "at": "2026-01-01T00:00:00+00:00",
            "type": "ValueError",
            "module": "builtins",
            "message": "7",
            "traceback": TRACEBACK,
        }
    ]
    job_id = make_job(
        task="shop.send",
        args={"order_id": 7, "note": "é"},
        state="dead",
        attempts=3,
        errors=errors,
    )

    readable = run("jobs", "show", str(job_id)).out.splitlines()
    raw = json.loads(run("jobs", "show", str(job_id), "--json").out)

    assert readable[0] == f"job {job_id}"
    assert "  state:        dead" in readable
    assert "  attempts:     3 of 3" in readable
    assert readable[readable.index("args:") + 1 :][:4] == [
        "    {",
        '      "note": "é",',
        '      "order_id": 7',
        "    }",
    ]
    start = readable.index("attempt 1 failed at 2026-01-01T00:00:00+00:00: ValueError: 7")
    assert readable[start + 1 : start + 5] == ["    " + line for line in TRACEBACK.splitlines()]
    assert raw["errors"] == errors


def test_job_view_of_a_job_with_no_errors_and_a_result() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    job = Job(
        id=5, queue="q", task="t", args={}, state=JobState("completed"), priority=0,
        run_at=now, retry_at=None, attempts=1, max_attempts=3, errors=[], worker_id=None,
        lease_expires_at=None, created_at=now, attempted_at=now, finished_at=now,
        result={"sent": True},
    )  # fmt: skip

    lines = job_view(job)

    assert "args:" in lines and lines[lines.index("args:") + 1] == "    {}"
    assert lines[lines.index("result:") + 1 :][:3] == ["    {", '      "sent": true', "    }"]
    assert lines[-1] == "errors: none"
    assert "  finished:     2026-01-01T00:00:00+00:00" in lines


# -- stored tracebacks -----------------------------------------------------------------


def _raise_in_user_code() -> None:
    raise KeyError("region")


def _scaffolding() -> None:
    _raise_in_user_code()


def test_a_traceback_of_internal_frames_only_is_kept_whole() -> None:
    try:
        _scaffolding()
    except KeyError as exc:
        caught = exc

    # With this file taken for skiplock's, no frame is the user's: a fault in skiplock.
    kept = format_handler_exception(caught, [__file__])

    assert kept == "".join(traceback.format_exception(caught))
    assert kept.count('File "') == 3


def test_a_frame_outside_is_kept_with_everything_after_it(tmp_path: Path) -> None:
    user = tmp_path / "user_code.py"
    user.write_text("def handler(call):\n    call()\n")
    namespace: dict[str, Any] = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)
    try:
        namespace["handler"](_raise_in_user_code)  # internal -> user -> internal
    except KeyError as exc:
        caught = exc

    text = format_handler_exception(caught, [__file__])

    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == "  [1 frame of skiplock and asyncio omitted]"
    assert lines[2].startswith(f'  File "{user}", line 2, in handler')
    assert "_raise_in_user_code" in text  # after the handler's frame: kept
    assert lines[-1] == "KeyError: 'region'"
    assert is_internal(skiplock.__file__)
    assert not is_internal(str(user))


def test_a_failed_job_stores_the_handlers_frames_only(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    @app.task(name="fails_in_a_thread", max_attempts=1)
    def fails_in_a_thread(order_id: int) -> None:
        raise ValueError(f"no order {order_id}")

    @app.task(name="fails_async", max_attempts=1)
    async def fails_async(order_id: int) -> None:
        raise ValueError(f"no order {order_id}")

    with app.connect() as conn:
        ids = [fails_in_a_thread.enqueue(conn, order_id=1), fails_async.enqueue(conn, order_id=2)]
        conn.commit()
    start_worker(app, queues=["default"])

    def dead() -> list[Job]:
        with app.connect() as conn:
            jobs = [client.get_job(conn, app.schema, job_id) for job_id in ids]
        return jobs if all(j.state == "dead" for j in jobs) else []

    wait_until(dead, 30, "both jobs to die")
    for job in dead():
        stored = job.errors[-1]["traceback"]
        lines = stored.splitlines()
        assert lines[1].startswith("  [") and lines[1].endswith(" of skiplock and asyncio omitted]")
        assert lines[2].startswith(f'  File "{__file__}"'), stored
        assert "executor.py" not in stored
        assert "asyncio" not in stored.replace("skiplock and asyncio omitted", "")


# -- queues list -----------------------------------------------------------------------


def test_queues_list_lists_every_queue_that_exists(
    app: skiplock.App, make_job: JobFactory, run: Any
) -> None:
    make_job(queue="emails")
    make_job(
        queue="emails",
        state="running",
        worker_id=uuid.uuid4(),
        lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
    )
    make_job(queue="reports", state="dead")
    pause(app, "paused-empty")
    assert run("queues", "limit", "emails", "--concurrency", "5").code == 0

    lines = run("queues", "list").out.splitlines()

    assert lines[0].split() == ["queue", "state", "ready", "running", "live", "workers", "limits"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["emails"] == ["emails", "active", "1", "1", "2", "0", "at", "most", "5", "running"]
    assert rows["paused-empty"] == ["paused-empty", "paused", "0", "0", "0", "0", "-"]
    assert rows["reports"] == ["reports", "active", "0", "0", "1", "0", "-"]


def test_queues_list_with_no_queue_says_when_one_appears(app: skiplock.App, run: Any) -> None:
    assert run("queues", "list").out.startswith("no queues yet: a queue exists once")


# -- migrate ---------------------------------------------------------------------------


def test_migrate_names_the_server_schema_and_versions_never_the_password(
    database_url: str, scratch_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    params = psycopg.conninfo.conninfo_to_dict(database_url)
    params["password"] = "hunter2"  # trust auth ignores it; it must not be printed
    url = psycopg.conninfo.make_conninfo("", **{k: str(v) for k, v in params.items() if v})
    latest = max(m.version for m in skiplock.migrate.available_migrations())

    def migrate(*args: str) -> list[str]:
        capsys.readouterr()
        assert cli.main(["--database-url", url, "--schema", scratch_schema, "migrate", *args]) == 0
        out = capsys.readouterr().out
        assert "hunter2" not in out
        return out.splitlines()

    first = migrate("--target", "2")
    rest = migrate()
    again = migrate()

    with psycopg.connect(database_url) as conn:
        info = conn.info
        where = f"{info.user}@{info.host}:{info.port}/{info.dbname} (PostgreSQL "
    assert first[0].startswith(where)
    assert first[0].endswith(f"), schema {scratch_schema!r}:")
    assert first[1:3] == ["  applied 0001_jobs", "  applied 0002_workers"]
    assert first[3] == f"schema {scratch_schema!r} is now at version 0002 " + (
        f"({latest - 2} pending up to {latest:04d})"
    )
    assert rest[-1] == f"schema {scratch_schema!r} is now at version {latest:04d} (the latest)"
    assert again == [first[0][:-1] + f": up to date, at version {latest:04d} (the latest)"]
