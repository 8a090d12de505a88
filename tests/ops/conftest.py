"""Fixtures for the operator-facing tests.

Every test that touches the database gets a schema of its own (``ops``), migrated to the
head and dropped afterwards. So the tables the top-level fixtures do not clean (leader,
queues, periodic) start empty as well, and the leader of a worker in one test never
prunes, rescues or elects over another test's rows.

``Ops`` writes rows in any state with any timestamps (jobs, history, registered workers)
straight into the tables, as another program's plain SQL would, and reads single values
back. Times are given either as an aware ``datetime`` or as seconds relative to the
database's ``now()`` (``-30`` is half a minute ago), so that ages are measured on one clock.
``cli`` runs the ``skiplock`` command in-process against the test's schema.
"""

from __future__ import annotations

import io
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

import skiplock
from conftest import WorkerThread
from skiplock import cli
from skiplock.sql import render

When = datetime | float | None

# Small intervals keep in-process workers quick to claim, elect and hand over.
FAST_WORKER: dict[str, Any] = {
    "poll_interval": 0.05,
    "rescue_interval": 0.05,
    "lease_seconds": 30.0,
    "shutdown_timeout": 5.0,
}


def _when(value: When) -> tuple[datetime | None, float | None]:
    """(absolute, offset) parameters for ``coalesce(%s, now() + %s * interval '1s')``."""
    if isinstance(value, datetime):
        return value, None
    return None, value


class Ops:
    """One migrated schema of a test's own, and ways to write and read its rows."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.app = skiplock.App(url, schema=schema)

    def connect(self, *, autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=autocommit, **kwargs)

    def table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema, name)

    # -- reading -----------------------------------------------------------------------

    def rows(self, template: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        """Run ``template`` ({jobs}, {history}, {workers}, ... name this schema's tables)."""
        with self.connect() as conn:
            cur = conn.execute(render(template, self.schema), params)
            return cur.fetchall() if cur.description else []

    def scalar(self, template: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        rows = self.rows(template, params)
        assert len(rows) == 1, rows
        return rows[0][0]

    def now(self) -> datetime:
        value = self.scalar("SELECT now()")
        assert isinstance(value, datetime)
        return value

    def state_of(self, job_id: int) -> str | None:
        """The job's state, live or finished; None when there is no such job."""
        rows = self.rows(
            "SELECT state FROM {jobs} WHERE id = %(id)s "
            "UNION ALL SELECT state FROM {history} WHERE id = %(id)s",
            {"id": job_id},
        )
        return None if not rows else str(rows[0][0])

    def count(self, table: str, where: str = "true", params: Sequence[Any] = ()) -> int:
        return int(self.scalar(f"SELECT count(*) FROM {{{table}}} WHERE {where}", params))

    # -- writing -----------------------------------------------------------------------

    def error(self, at: float, message: str = "boom", attempt: int = 1) -> dict[str, Any]:
        """An error record stamped ``at`` seconds from the database's now."""
        stamp = self.now() + timedelta(seconds=at)
        return {
            "attempt": attempt,
            "at": stamp.isoformat(),
            "type": "ValueError",
            "message": message,
            "traceback": None,
        }

    def job(
        self,
        *,
        state: str = "available",
        queue: str = "default",
        task: str = "noop",
        args: dict[str, Any] | None = None,
        priority: int = 0,
        run_at: When = 0.0,
        retry_at: When = None,
        attempts: int = 0,
        max_attempts: int = 3,
        errors: list[dict[str, Any]] | None = None,
        worker_id: uuid.UUID | None = None,
        lease_expires_at: When = None,
        created_at: When = None,
        attempted_at: When = None,
    ) -> int:
        """Write one job row in any state, bypassing every check of the Python client."""
        if state == "running":
            worker_id = worker_id or uuid.uuid4()
            lease_expires_at = 30.0 if lease_expires_at is None else lease_expires_at
            attempts = max(attempts, 1)
            attempted_at = -1.0 if attempted_at is None else attempted_at
        params: dict[str, Any] = {
            "task": task,
            "args": Jsonb(args or {}),
            "queue": queue,
            "state": state,
            "priority": priority,
            "attempts": attempts,
            "max_attempts": max_attempts,
            "errors": Jsonb(errors or []),
            "worker_id": worker_id,
        }
        for column, value in (
            ("run_at", run_at),
            ("retry_at", retry_at),
            ("lease_expires_at", lease_expires_at),
            ("created_at", created_at),
            ("attempted_at", attempted_at),
        ):
            params[f"{column}_abs"], params[f"{column}_rel"] = _when(value)

        def at(column: str) -> str:
            return (
                f"coalesce(%({column}_abs)s::timestamptz, "
                f"now() + %({column}_rel)s::float8 * interval '1 second')"
            )

        statement = (
            "INSERT INTO {jobs} (task, args, queue, state, priority, run_at, retry_at, "
            "attempts, max_attempts, errors, worker_id, lease_expires_at, created_at, "
            "attempted_at) VALUES (%(task)s, %(args)s, %(queue)s, %(state)s, %(priority)s, "
            f"{at('run_at')}, {at('retry_at')}, %(attempts)s, %(max_attempts)s, %(errors)s, "
            f"%(worker_id)s, {at('lease_expires_at')}, "
            f"coalesce({at('created_at')}, now()), {at('attempted_at')}) RETURNING id"
        )
        return int(self.scalar(statement, params))

    def history(
        self,
        *,
        finished_at: When = 0.0,
        state: str = "completed",
        queue: str = "default",
        task: str = "noop",
        attempts: int = 1,
        errors: list[dict[str, Any]] | None = None,
        count: int = 1,
    ) -> list[int]:
        """Write ``count`` finished jobs into job_history; their ids come from the jobs
        table's own sequence, so they never collide with live jobs."""
        absolute, relative = _when(finished_at)
        rows = self.rows(
            "INSERT INTO {history} (id, queue, task, args, state, priority, attempts, "
            "max_attempts, errors, created_at, attempted_at, finished_at) "
            "SELECT nextval(pg_get_serial_sequence(%(jobs)s, 'id')), %(queue)s, %(task)s, "
            "'{{}}'::jsonb, %(state)s, 0, %(attempts)s, 3, %(errors)s, f, f, f "
            "FROM (SELECT coalesce(%(abs)s::timestamptz, "
            "      now() + %(rel)s::float8 * interval '1 second') AS f) AS finished, "
            "     generate_series(1, %(count)s) "
            "RETURNING id",
            {
                "jobs": f'"{self.schema}".jobs',
                "queue": queue,
                "task": task,
                "state": state,
                "attempts": attempts,
                "errors": Jsonb(errors or []),
                "abs": absolute,
                "rel": relative,
                "count": count,
            },
        )
        return [int(r[0]) for r in rows]

    def worker(
        self,
        *,
        queues: Sequence[str] = ("default",),
        last_seen: float = 0.0,
        holds_lock: bool = True,
        concurrency: int = 10,
    ) -> uuid.UUID:
        """Register a worker that no process backs (its liveness lock is free)."""
        worker_id = uuid.uuid4()
        self.rows(
            "INSERT INTO {workers} (id, host, pid, queues, concurrency, holds_lock, "
            "last_seen_at) VALUES (%s, 'ops-test-host', 4242, %s, %s, %s, "
            "now() + %s * interval '1 second')",
            (worker_id, list(queues), concurrency, holds_lock, last_seen),
        )
        return worker_id


@pytest.fixture
def ops(database_url: str) -> Iterator[Ops]:
    """A schema of this test's own, migrated to the head; dropped afterwards."""
    schema = f"ops_{uuid.uuid4().hex[:8]}"
    skiplock.App(database_url, schema=schema).migrate()
    yield Ops(database_url, schema)
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute("SET lock_timeout = '20s'")
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def unmigrated_schema(database_url: str) -> Iterator[str]:
    """A schema name nothing has created yet; dropped afterwards in case a test did."""
    schema = f"ops_{uuid.uuid4().hex[:8]}"
    yield schema
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# -- workers -------------------------------------------------------------------------

StartWorker = Callable[..., WorkerThread]


@pytest.fixture
def run_worker(ops: Ops) -> Iterator[StartWorker]:
    """Start a real in-process worker on the test's schema (keyword arguments go to
    ``skiplock.Worker`` over FAST_WORKER); every one is stopped before the schema goes."""
    started: list[WorkerThread] = []

    def start(app: skiplock.App | None = None, **options: Any) -> WorkerThread:
        handle = WorkerThread(skiplock.Worker(app or ops.app, **{**FAST_WORKER, **options}))
        started.append(handle)
        return handle.start()

    yield start
    failures: list[BaseException] = []
    for handle in started:
        try:
            handle.stop()
        except BaseException as exc:
            failures.append(exc)
    if failures:
        raise failures[0]


# -- the command line ----------------------------------------------------------------


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


class Terminal(io.StringIO):
    """Standard input that claims to be a terminal, with the operator's answers in it."""

    def isatty(self) -> bool:
        return True


class Cli:
    """``skiplock --database-url URL --schema SCHEMA ...``, run in this process."""

    def __init__(
        self, ops: Ops, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._ops = ops
        self._capsys = capsys
        self._monkeypatch = monkeypatch

    def __call__(self, *args: str, answer: str | None = None) -> CliResult:
        """Run with standard input that is not a terminal, or, given ``answer``, a
        terminal on which the operator types it."""
        stdin = io.StringIO("") if answer is None else Terminal(answer + "\n")
        self._monkeypatch.setattr(sys, "stdin", stdin)
        self._capsys.readouterr()
        code = cli.main(["--database-url", self._ops.url, "--schema", self._ops.schema, *args])
        captured = self._capsys.readouterr()
        assert "Traceback" not in captured.err
        return CliResult(code, captured.out, captured.err)


@pytest.fixture
def run_cli(ops: Ops, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    return Cli(ops, capsys, monkeypatch)
