"""What a worker says about its jobs (the ``skiplock.jobs`` logger).

Each failed attempt at WARNING with the task, the job id, attempt/max and the exception
(type and message), its traceback at the first and the last attempt only; a dead job at
ERROR; claims and completions at INFO, which ``skiplock worker -v`` turns on and which is
off otherwise. Through a real worker: in process with caplog, and as the CLI's process.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest

import skiplock
import test_crash
from conftest import StartWorker, wait_until
from processes import WorkerProcess, kill_all, spawn_worker_process
from skiplock.retry import RetryPolicy
from test_crash import LEASED, QUEUE, WORKER_APP, all_finished, enqueue
from test_worker import state_of

NO_BACK_OFF = RetryPolicy(base=0.0, cap=0.0, jitter=0.0)
TRACEBACK = "Traceback (most recent call last)"

# The crash tests' fixtures: their app's tables (tests/crash_app.py).
crash_tables = test_crash.crash_tables
db = test_crash.db


def about(caplog: pytest.LogCaptureFixture, job_id: int) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "skiplock.jobs" and getattr(r, "job_id", None) == job_id
    ]


def test_each_failed_attempt_is_a_warning_and_a_dead_job_an_error(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="skiplock.jobs")

    @app.task(name="flaky", max_attempts=3, retry=NO_BACK_OFF)
    def flaky(n: int) -> None:
        raise ValueError(f"boom {n}")

    start_worker(app, poll_interval=0.05)
    with psycopg.connect(app.database_url) as conn:
        job_id = flaky.enqueue(conn, n=42)
    wait_until(lambda: state_of(autocommit, job_id) == "dead", 15.0, "the job to die")
    wait_until(lambda: len(about(caplog, job_id)) >= 3, 5.0, "three records")

    records = about(caplog, job_id)
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING, logging.ERROR]
    messages = [r.getMessage() for r in records]
    for attempt, message in enumerate(messages, start=1):
        assert f"job {job_id} (flaky) failed, attempt {attempt}/3: ValueError: boom 42" in message
    assert "retrying" in messages[0] and "dead" in messages[2]
    # The traceback at the first and the last attempt, not in between.
    assert [TRACEBACK in m for m in messages] == [True, False, True]
    assert "raise ValueError" in messages[0]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_transactional_failure_is_logged_with_its_exception(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="skiplock.jobs")

    if kind == "sync":

        @app.task(name="tx", transactional=True, max_attempts=2, retry=NO_BACK_OFF)
        def tx(conn: Any, n: int) -> None:
            raise KeyError(f"missing {n}")

    else:

        @app.task(name="tx", transactional=True, max_attempts=2, retry=NO_BACK_OFF)
        async def tx(conn: Any, n: int) -> None:
            raise KeyError(f"missing {n}")

    start_worker(app, poll_interval=0.05)
    with psycopg.connect(app.database_url) as conn:
        job_id = tx.enqueue(conn, n=7)
    wait_until(lambda: state_of(autocommit, job_id) == "dead", 15.0, "the job to die")
    wait_until(lambda: len(about(caplog, job_id)) >= 2, 5.0, "two records")

    records = about(caplog, job_id)
    assert [r.levelno for r in records] == [logging.WARNING, logging.ERROR]
    messages = [r.getMessage() for r in records]
    for attempt, message in enumerate(messages, start=1):
        assert f"job {job_id} (tx) failed, attempt {attempt}/2: KeyError: 'missing 7'" in message
    assert "dead" in messages[1]
    assert all(TRACEBACK in m for m in messages)  # the first and the last attempt


def test_claims_and_completions_are_info_and_off_by_default(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    @app.task(name="fine")
    async def fine() -> int:
        return 1

    caplog.set_level(logging.WARNING, logger="skiplock.jobs")
    start_worker(app, poll_interval=0.05)
    with psycopg.connect(app.database_url) as conn:
        quiet = fine.enqueue(conn)
    wait_until(lambda: state_of(autocommit, quiet) == "completed", 15.0, "the first job")
    assert about(caplog, quiet) == []

    caplog.set_level(logging.INFO, logger="skiplock.jobs")
    with psycopg.connect(app.database_url) as conn:
        told = fine.enqueue(conn)
    wait_until(lambda: state_of(autocommit, told) == "completed", 15.0, "the second job")
    wait_until(lambda: len(about(caplog, told)) >= 2, 5.0, "two records")

    messages = [(r.levelno, r.getMessage()) for r in about(caplog, told)]
    assert messages[0] == (logging.INFO, f"job {told} (fine) claimed from default, attempt 1/3")
    assert messages[1][0] == logging.INFO
    assert messages[1][1].startswith(f"job {told} (fine) completed in ")


# -- the CLI ---------------------------------------------------------------------------


def run_worker(
    database_url: str, log_path: Path, options: list[str], worker_options: list[str]
) -> WorkerProcess:
    return spawn_worker_process(
        database_url,
        WORKER_APP,
        *("--queues", QUEUE, "--poll-interval", "0.1", *worker_options),
        options=options,
        log_path=log_path,
        env={"SKIPLOCK_DATABASE_URL": database_url},
    )


def stop(worker: WorkerProcess) -> None:
    worker.send(signal.SIGTERM)
    try:
        worker.proc.wait(timeout=20.0)
    finally:
        kill_all([worker])


@pytest.mark.parametrize(
    ("verbose", "processes"),
    [(False, []), (True, []), (True, ["--processes", "1"])],
    ids=["plain", "-v", "-v --processes"],
)
def test_skiplock_worker_shows_failures_and_with_v_claims_and_completions(
    app: skiplock.App,
    db: psycopg.Connection[Any],
    database_url: str,
    tmp_path: Path,
    verbose: bool,
    processes: list[str],
) -> None:
    ok = enqueue(app, db, LEASED)[0]
    # Arguments the handler does not take: a TypeError at every attempt.
    bad = enqueue(app, db, LEASED, bogus=1)[0]
    log_path = tmp_path / "worker.log"
    failed = f"job {bad} ({LEASED}) failed, attempt 1/5: TypeError: "

    # With --processes, the worker processes are the supervisor's children: -v is theirs too.
    proc = run_worker(database_url, log_path, ["-v"] if verbose else [], processes)
    try:
        wait_until(
            lambda: all_finished(db, [ok]) and failed in log_path.read_text(),
            30.0,
            "the good job to finish and the bad one to fail",
        )
    finally:
        stop(proc)
    log = log_path.read_text()

    line = next(line for line in log.splitlines() if failed in line)
    assert " WARNING skiplock.jobs: " in line
    assert TRACEBACK in log.split(failed, 1)[1]  # the first attempt's traceback follows
    told = [f"job {ok} ({LEASED}) claimed from {QUEUE}", f"job {ok} ({LEASED}) completed in "]
    assert [text in log for text in told] == [verbose, verbose]
