"""Fixtures for the Django integration: the backend, clean skiplock tables, and a real
skiplock worker running Django tasks in this process (or, in test_worker_process.py, in
a process of its own).

Run with pytest-django: ``pytest tests_django --ds=tests_django.settings`` (scripts/test-django
does, in both Django environments and against both servers).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from skiplock.contrib.django.backend import SkiplockBackend
from skiplock.contrib.django.compat import TaskResultDoesNotExist, task_backends
from skiplock.contrib.django.worker import DjangoTasksApp, database_conninfo


def wait_until(predicate: Callable[[], object], timeout: float = 15.0, what: str = "it") -> None:
    """Poll ``predicate`` until it is truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


@pytest.fixture
def backend() -> SkiplockBackend:
    found = task_backends["default"]
    assert isinstance(found, SkiplockBackend)
    return found


def clean_skiplock_tables(url: str, schema: str = "skiplock") -> None:
    """Empty skiplock's tables (Django's flush leaves tables it has no model for)."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT c.relname FROM pg_class c "
            "WHERE c.relnamespace = %s::regnamespace AND c.relkind IN ('r', 'p') "
            "AND NOT c.relispartition AND c.relname <> 'schema_migrations' ORDER BY 1",
            (schema,),
        ).fetchall()
        conn.execute(
            sql.SQL("TRUNCATE {} RESTART IDENTITY").format(
                sql.SQL(", ").join(sql.Identifier(schema, name) for (name,) in tables)
            )
        )


@pytest.fixture
def database_url(transactional_db: None) -> str:
    """The test database as a libpq string, over empty skiplock tables; for tests whose
    writes commit (a worker must see them)."""
    url = database_conninfo("default")
    clean_skiplock_tables(url)
    return url


class WorkerThread:
    """A real skiplock worker for the backend's Django tasks, on its own thread."""

    def __init__(self, worker: skiplock.Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="test-worker", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.worker.run_async())
        except BaseException as exc:
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        wait_until(
            lambda: self.worker.ready.is_set() or not self.thread.is_alive(),
            20.0,
            "the worker to start",
        )
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.worker.request_stop()
            self.thread.join(30.0)
            assert not self.thread.is_alive(), "the worker did not stop in time"
        if self.error is not None:
            raise self.error


StartWorker = Callable[..., WorkerThread]


@pytest.fixture
def start_worker(database_url: str, backend: SkiplockBackend) -> Iterator[StartWorker]:
    """Start a worker over the backend's queues (keyword arguments go to skiplock.Worker);
    stopped at teardown."""
    started: list[WorkerThread] = []

    def start(**options: Any) -> WorkerThread:
        app = DjangoTasksApp(backend)
        options.setdefault("queues", sorted(backend.queues))
        options.setdefault("poll_interval", 0.05)
        worker = skiplock.Worker(app, **options)
        app.worker_id = str(worker.id)
        handle = WorkerThread(worker)
        started.append(handle)
        return handle.start()

    yield start
    for handle in started:
        handle.stop()


def finished_result(backend: SkiplockBackend, result_id: str, timeout: float = 15.0) -> Any:
    """The task result once it is SUCCESSFUL or FAILED."""
    found: list[Any] = []

    def done() -> bool:
        try:
            found[:] = [backend.get_result(result_id)]
        except TaskResultDoesNotExist:
            return False
        return bool(found[0].is_finished)

    wait_until(done, timeout, f"task result {result_id} to finish")
    return found[0]
