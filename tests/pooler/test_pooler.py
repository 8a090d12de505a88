"""Workers behind PgBouncer in transaction mode: their settings, where their sessions go,
rescue through the pooler, and telling a transaction-mode pooler (``skiplock doctor``).

The settings tests need no server; the others run through the PgBouncer of conftest.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import skiplock
from conftest import SCHEMA, JobFactory, StartWorker, WorkerThread, wait_until
from pooler import pooled_app
from pooler.bouncer import PgBouncer
from skiplock import doctor, pooler
from skiplock.errors import ConfigurationError
from skiplock.pooler import WorkerConnections, detect_transaction_pooling
from skiplock.sql import maintenance, render
from skiplock.worker import options
from skiplock.worker.options import WorkerOptions

# -- settings (no server) ----------------------------------------------------------------


def test_a_pooler_without_a_listen_url_means_polling_every_fifth_of_a_second() -> None:
    app = skiplock.App("postgresql://nowhere/db")
    worker = skiplock.Worker(app, pooler=True)
    assert not worker.listen
    assert worker.poll_interval == pooler.POLL_ONLY_INTERVAL
    assert not worker.liveness_lock  # rescued by lease expiry, as with --no-liveness-lock


def test_a_pooler_with_a_listen_url_listens_and_holds_the_lock_there() -> None:
    app = skiplock.App("postgresql://pooler/db")
    worker = skiplock.Worker(app, pooler=True, listen_url="postgresql://direct/db")
    assert worker.listen and worker.liveness_lock
    assert worker.poll_interval == pooler.POLL_INTERVAL
    # The listen URL, with the worker's keepalive parameters added (keepalives.py).
    dedicated = conninfo_to_dict(worker.connections.dedicated_url)
    assert (dedicated["host"], dedicated["dbname"]) == ("direct", "db")
    assert "tcp_user_timeout" in dedicated
    assert not worker.connections.session_locks


def test_an_explicit_poll_interval_wins_and_no_listen_works_without_a_pooler() -> None:
    app = skiplock.App("postgresql://direct/db")
    worker = skiplock.Worker(app, listen=False, poll_interval=0.5)
    assert not worker.listen and worker.poll_interval == 0.5
    assert worker.liveness_lock  # its pool connections hold it: they are direct
    assert skiplock.Worker(app, listen=False).poll_interval == pooler.POLL_ONLY_INTERVAL
    assert skiplock.Worker(app).poll_interval == pooler.POLL_INTERVAL


def test_an_empty_listen_url_is_refused() -> None:
    app = skiplock.App("postgresql://pooler/db")
    with pytest.raises(ConfigurationError, match="listen_url is empty"):
        skiplock.Worker(app, pooler=True, listen_url=" ")


def test_pooled_connections_send_no_options_and_prepare_nothing() -> None:
    through = WorkerConnections("postgresql://pooler/db", "postgresql://direct/db", pooler=True)
    assert through.pooled("-c synchronous_commit=off") == {"prepare_threshold": None}
    assert through.dedicated("-c x=1") == {"options": "-c x=1"}
    alone = WorkerConnections("postgresql://pooler/db", pooler=True)
    assert alone.dedicated("-c x=1") == {"prepare_threshold": None}
    direct = WorkerConnections("postgresql://direct/db")
    assert direct.pooled("-c x=1") == {"options": "-c x=1"} and direct.session_locks


def test_the_worker_command_options_reach_the_worker_and_the_children() -> None:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    given = vars(parser.parse_args(["--pooler", "--listen-url", "postgresql://direct/db"]))
    settings = WorkerOptions.from_arguments(given, {})
    assert (settings.pooler, settings.listen, settings.listen_url) == (
        True,
        True,
        "postgresql://direct/db",
    )
    env: dict[str, str] = {}
    # The URL may hold a password: to the children through their environment only.
    pooler_flags = {"--pooler", "--listen-url", "--no-listen"}
    assert [a for a in options.child_arguments(given, env) if a in pooler_flags] == ["--pooler"]
    assert env == {pooler.LISTEN_URL_ENV: "postgresql://direct/db"}
    given = vars(parser.parse_args(["--no-listen", "--poll-interval", "0.5"]))
    settings = WorkerOptions.from_arguments(given, {pooler.LISTEN_URL_ENV: "postgresql://env/db"})
    assert (settings.pooler, settings.listen, settings.listen_url) == (
        False,
        False,
        "postgresql://env/db",
    )
    argv = options.child_arguments(given, {})
    assert argv[argv.index("--poll-interval") + 1] == "0.5"
    assert [a for a in argv if a in pooler_flags] == ["--no-listen"]


# -- telling a transaction-mode pooler ---------------------------------------------------


def connector(url: str) -> Any:
    return lambda: psycopg.connect(url, prepare_threshold=None)


def test_a_direct_connection_is_not_taken_for_a_pooler(database_url: str) -> None:
    report = detect_transaction_pooling(connector(database_url))
    assert not report.transaction_pooling, report.evidence


def test_pgbouncer_in_transaction_mode_is_detected(pooled_url: str) -> None:
    report = detect_transaction_pooling(connector(pooled_url))
    assert report.transaction_pooling, report.evidence


def test_a_pool_of_one_server_connection_is_detected_by_the_wait(
    bouncer: PgBouncer, database_url: str
) -> None:
    single = bouncer.url(database_url, single=True)
    report = detect_transaction_pooling(connector(single), wait_seconds=0.5)
    assert report.transaction_pooling, report.evidence


def test_doctor_says_which_worker_settings_to_use_behind_the_pooler(
    database_url: str, pooled_url: str
) -> None:
    with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as conn:
        [finding] = doctor.check_pooler(conn, SCHEMA, doctor.Limits())
    assert finding.level == "warn" and "transaction mode" in finding.message
    assert "--pooler" in finding.fix and "--listen-url" in finding.fix
    with psycopg.connect(database_url, autocommit=True) as conn:
        [finding] = doctor.check_pooler(conn, SCHEMA, doctor.Limits())
    assert finding.level == "ok", finding


# -- where a worker's sessions go --------------------------------------------------------


def advisory_holders(database_url: str) -> list[str]:
    """The application names of the sessions holding a shared advisory lock: the
    liveness lock (an idle worker's wake-up session holds its queues' sentinel keys too,
    exclusively: decision 023)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database() "
            "  AND l.mode = 'ShareLock' "
            "ORDER BY 1"
        ).fetchall()
    return [str(row[0]) for row in rows]


def registered_holds_lock(database_url: str, worker_id: uuid.UUID) -> bool:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            render("SELECT holds_lock FROM {workers} WHERE id = %s", SCHEMA), (worker_id,)
        ).fetchone()
    assert row is not None, "the worker is not registered"
    return bool(row[0])


def test_with_a_listen_url_only_the_listener_and_the_heartbeat_hold_the_lock(
    app: skiplock.App, start_worker: StartWorker, database_url: str
) -> None:
    handle = start_worker(app, rescue_interval=0.1, lease_seconds=3.0)
    worker_id = handle.worker.id
    assert registered_holds_lock(database_url, worker_id)
    expected = [f"skiplock heartbeat {worker_id}", f"skiplock listener {worker_id}"]
    wait_until(lambda: advisory_holders(database_url) == expected, 10, "the two lock holders")


def test_poll_only_registers_without_the_lock_and_takes_none(
    app: skiplock.App, start_worker: StartWorker, database_url: str
) -> None:
    handle = start_worker(app, listen_url=None)
    assert not handle.worker.listen
    assert not registered_holds_lock(database_url, handle.worker.id)
    assert advisory_holders(database_url) == []


# -- rescue through the pooler -----------------------------------------------------------


def test_a_job_whose_lease_ran_out_is_rescued_and_run_by_a_poll_only_worker(
    app: skiplock.App, start_worker: StartWorker, make_job: JobFactory, database_url: str
) -> None:
    ran = threading.Event()

    @app.task(name="noop")
    def noop() -> None:
        ran.set()

    job_id = make_job(
        state="running",
        attempts=1,
        worker_id=uuid.uuid4(),
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    start_worker(app, listen_url=None, rescue_interval=0.1, lease_seconds=1.0)
    assert ran.wait(20), "the expired job was not rescued and run"
    wait_until(lambda: job_gone(database_url, job_id), 10, "the job to complete")


def test_a_dead_workers_job_is_rescued_at_once_through_its_free_lock(
    app: skiplock.App, start_worker: StartWorker, make_job: JobFactory, database_url: str
) -> None:
    """A registered worker that holds the lock (its listener on a direct URL) and whose
    sessions are all gone: its job is rescued without waiting out a lease of an hour."""
    ran = threading.Event()

    @app.task(name="noop")
    def noop() -> None:
        ran.set()

    dead = uuid.uuid4()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            render(maintenance.WORKER_REGISTER, SCHEMA),
            {
                "id": dead,
                "host": "gone",
                "pid": 1,
                "queues": ["default"],
                "concurrency": 1,
                "holds_lock": True,
            },
        )
    job_id = make_job(
        state="running",
        attempts=1,
        worker_id=dead,
        lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
    )
    start_worker(app, rescue_interval=0.1)
    assert ran.wait(20), "the dead worker's job was not rescued and run"
    wait_until(lambda: job_gone(database_url, job_id), 10, "the job to complete")


def job_gone(database_url: str, job_id: int) -> bool:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            render("SELECT state FROM {history} WHERE id = %s", SCHEMA), (job_id,)
        ).fetchone()
    return row is not None and row[0] == "completed"


# -- the command -------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_the_worker_command_with_processes_drains_through_the_pooler(
    app: skiplock.App, database_url: str, pooled_url: str, tmp_path: Path
) -> None:
    """``skiplock worker --processes 2 --pooler`` with the listen URL in its environment:
    both children listen and hold the lock on the direct URL, and drain through the pooler."""
    env = {
        **os.environ,
        "SKIPLOCK_DATABASE_URL": pooled_url,
        pooler.LISTEN_URL_ENV: database_url,
    }
    command = [
        *(sys.executable, "-m", "skiplock", "worker", "tests.pooler.pooled_app:app"),
        *("--processes", "2", "--concurrency", "4", "--pooler"),
    ]
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with psycopg.connect(pooled_url, prepare_threshold=None) as conn:
            app.enqueue_many(conn, [pooled_app.pooled.job(n=n) for n in range(40)])
            conn.commit()
        with psycopg.connect(database_url, autocommit=True) as conn:

            def drained() -> bool:
                row = conn.execute(
                    "SELECT (SELECT count(*) FROM skiplock.jobs), "
                    "(SELECT count(*) FROM skiplock.job_history WHERE state = 'completed'), "
                    "(SELECT count(*) FROM skiplock.workers WHERE holds_lock)"
                ).fetchone()
                return row == (0, 40, 2)

            wait_until(drained, 30, "two lock-holding workers to drain 40 jobs")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("options", "bounded"),
    [({}, True), ({"pooler": True, "listen_url": "direct"}, True), ({"pooler": True}, False)],
    ids=["direct", "listen-url", "poll-only"],
)
def test_the_heartbeat_keeps_its_statement_bounds_unless_it_goes_through_the_pooler(
    app: skiplock.App,
    database_url: str,
    pooled_url: str,
    options: dict[str, Any],
    bounded: bool,
) -> None:
    if options.get("listen_url") == "direct":
        options = {**options, "listen_url": database_url}
    url = pooled_url if options.get("pooler") else database_url
    handle = WorkerThread(skiplock.Worker(skiplock.App(url, schema=SCHEMA), **options)).start()
    try:
        assert handle.worker.parts is not None
        heartbeat = handle.worker.parts.heartbeat
        kwargs = heartbeat._connect_kwargs
        if bounded:
            assert "statement_timeout" in kwargs["options"], kwargs
        else:
            assert kwargs == {"prepare_threshold": None}
    finally:
        handle.stop()


def test_a_worker_not_told_about_pgbouncer_stops_at_once_saying_what_to_use(
    app: skiplock.App,
) -> None:
    """PgBouncer refuses the ``options`` a worker's connections carry: instead of retrying
    for ever, the worker stops with the settings to use."""
    worker = skiplock.Worker(app)  # app.database_url goes through the pooler
    with pytest.raises(ConfigurationError, match="--pooler"):
        asyncio.run(asyncio.wait_for(worker.run_async(), 20))
