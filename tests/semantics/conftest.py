"""Fixtures for the job-semantics tests.

Every test gets a schema of its own (``sem_xxxxxxxx``), migrated to the head and dropped
afterwards, and an ``App`` over it (``sem.app``) on which the test registers its tasks
(with explicit names: they are defined inside the test). So no test depends on another
one's rows, on table cleaning, or on which worker is the leader elsewhere.

``workers(count, **options)`` starts that many real ``skiplock.Worker``\\s over the schema,
each on its own event loop and thread, with small intervals (``FAST``) so that claims,
heartbeats and progress writes happen quickly; all are stopped before the schema goes.
Tests wait on conditions with a deadline (``sem.wait_for_state``, ``wait_until``) or on
events set by handlers, never on a sleep.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import WorkerThread, wait_until
from skiplock import cli, client
from skiplock.sql import render
from skiplock.tasks import TaskCall

# Quick claims (the fallback poll), quick progress writes (the maintenance loop runs every
# rescue_interval), and a bounded stop.
FAST: dict[str, Any] = {
    "poll_interval": 0.05,
    "rescue_interval": 0.1,
    "shutdown_timeout": 5.0,
    "concurrency": 4,
}

Enqueueable = skiplock.Task[Any] | TaskCall[Any]


class Sem:
    """One migrated schema of a test's own: its App, and ways to enqueue and read jobs."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.app = skiplock.App(url, schema=schema)

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=autocommit)

    # -- writing -----------------------------------------------------------------------

    def enqueue(self, task: Enqueueable, /, **args: Any) -> skiplock.JobRef:
        """Enqueue in a transaction of its own, committed."""
        with self.connect(autocommit=False) as conn:
            ref = task.enqueue(conn, **args)
            conn.commit()
        return ref

    def enqueue_many(self, specs: Sequence[skiplock.JobSpec]) -> list[int]:
        with self.connect(autocommit=False) as conn:
            ids = self.app.enqueue_many(conn, specs)
            conn.commit()
        return ids

    def execute(self, template: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        """Run ``template`` ({jobs}, {history}, ... name this schema's tables), committed."""
        with self.connect() as conn:
            cur = conn.execute(render(template, self.schema), params)
            return cur.fetchall() if cur.description else []

    # -- reading -----------------------------------------------------------------------

    def job(self, job_id: int) -> skiplock.Job:
        """The job, live or finished (raises JobNotFoundError when there is none)."""
        with self.connect() as conn:
            return client.get_job(conn, self.schema, job_id)

    def state_of(self, job_id: int) -> str | None:
        try:
            return str(self.job(job_id).state)
        except skiplock.JobNotFoundError:
            return None

    def wait_for_state(self, job_id: int, *states: str, timeout: float = 15.0) -> skiplock.Job:
        """Poll until the job is in one of ``states``; returns it as then read."""
        found: list[skiplock.Job] = []

        def reached() -> bool:
            try:
                job = self.job(job_id)
            except skiplock.JobNotFoundError:
                return False
            found[:] = [job]
            return str(job.state) in states

        wait_until(reached, timeout, f"job {job_id} to be {' or '.join(states)}")
        return found[0]

    def wait_for_all(self, ids: Sequence[int], *states: str, timeout: float = 20.0) -> None:
        """Poll until every job in ``ids`` is in one of ``states``."""
        wanted = list(ids)

        def reached() -> bool:
            rows = self.execute(
                "SELECT count(*) FROM (SELECT id, state FROM {jobs} UNION ALL "
                "SELECT id, state FROM {history}) AS j "
                "WHERE id = ANY(%(ids)s) AND state = ANY(%(states)s)",
                {"ids": wanted, "states": list(states)},
            )
            return int(rows[0][0]) == len(wanted)

        wait_until(reached, timeout, f"{len(wanted)} jobs to be {' or '.join(states)}")

    def live_count(self) -> int:
        return int(self.execute("SELECT count(*) FROM {jobs}")[0][0])

    def waiting_on_lock(self, backend_pid: int) -> bool:
        """True while that backend waits for a lock (e.g. on another's uncommitted row)."""
        rows = self.execute(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
            (backend_pid,),
        )
        return bool(rows and rows[0][0])


@pytest.fixture
def sem(database_url: str) -> Iterator[Sem]:
    """A schema of this test's own, migrated to the head; dropped afterwards."""
    schema = f"sem_{uuid.uuid4().hex[:8]}"
    skiplock.App(database_url, schema=schema).migrate()
    yield Sem(database_url, schema)
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute("SET lock_timeout = '20s'")
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


StartWorkers = Callable[..., list[WorkerThread]]


@pytest.fixture
def workers(sem: Sem) -> Iterator[StartWorkers]:
    """Start ``count`` workers on the test's schema (keyword arguments go to
    ``skiplock.Worker`` over ``FAST``); every one is stopped before the schema goes."""
    started: list[WorkerThread] = []

    def start(count: int = 1, **options: Any) -> list[WorkerThread]:
        handles = [
            WorkerThread(skiplock.Worker(sem.app, **{**FAST, **options})) for _ in range(count)
        ]
        started.extend(handles)
        for handle in handles:
            handle.start()
        return handles

    yield start
    failures: list[BaseException] = []
    for handle in started:
        # All at once, so that they drain in parallel. Worker.request_stop raises once the
        # worker's loop is closed: one that stopped meanwhile needs no request.
        with contextlib.suppress(RuntimeError):
            if handle.alive:
                handle.request_stop()
    for handle in started:
        try:
            handle.join()
        except BaseException as exc:
            failures.append(exc)
    if failures:
        raise failures[0]


class Calls:
    """Thread-safe record of handler runs: how often per key, and which keys got where."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[Any] = Counter()
        self.marks: dict[str, set[Any]] = {}

    def record(self, key: Any) -> int:
        """Count one run for ``key``; returns how many runs it has had, this one included."""
        with self._lock:
            self.counts[key] += 1
            return self.counts[key]

    def mark(self, label: str, key: Any) -> None:
        with self._lock:
            self.marks.setdefault(label, set()).add(key)

    def marked(self, label: str) -> set[Any]:
        with self._lock:
            return set(self.marks.get(label, ()))


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


RunCli = Callable[..., CliResult]


@pytest.fixture
def run_cli(
    sem: Sem, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> RunCli:
    """``skiplock --database-url URL --schema SCHEMA ...`` in this process; stdin is not a
    terminal, so nothing prompts."""

    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))
        capsys.readouterr()
        code = cli.main(["--database-url", sem.url, "--schema", sem.schema, *args])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
