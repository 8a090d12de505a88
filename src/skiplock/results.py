"""Waiting for a job's result: woken by the completer's per-flush notification, with a
slow poll as the fallback (the notification is only a wake-up, as everywhere here)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from skiplock import client
from skiplock.config import done_channel
from skiplock.errors import JobFailedError
from skiplock.types import Job, JobState

if TYPE_CHECKING:
    from skiplock.app import App

POLL_SECONDS = 1.0
# The wait runs the same query once a second; psycopg would prepare it on the server after
# five runs, and through a pooler in transaction mode (PgBouncer < 1.21) the next poll may
# reach a server connection that lacks it, or whose other client prepared the same name:
# its connection prepares nothing.


def _settled(job: Job) -> bool:
    if job.state is JobState.COMPLETED:
        return True
    if job.state in (JobState.DEAD, JobState.CANCELLED):
        raise JobFailedError(
            f"job {job.id} ({job.task}) is {job.state}"
            + (f"; last error {job.last_error}" if job.last_error else "")
        )
    return False


class _Deadline:
    """How long each wait for a notification may last: a poll's interval, cut to what is
    left of ``timeout``; TimeoutError once nothing is left (None waits for ever)."""

    def __init__(self, job_id: int, timeout: float | None) -> None:
        self._job_id = job_id
        self._timeout = timeout
        self._at = None if timeout is None else time.monotonic() + timeout

    def next_wait(self) -> float:
        if self._at is None:
            return POLL_SECONDS
        wait = min(POLL_SECONDS, self._at - time.monotonic())
        if wait <= 0:
            raise TimeoutError(f"job {self._job_id} did not finish within {self._timeout}s")
        return wait


def _listen(schema: str) -> sql.Composed:
    return sql.SQL("LISTEN {}").format(sql.Identifier(done_channel(schema)))


def wait_for_result(app: App, job_id: int, timeout: float | None = None) -> Any:
    """The job's stored result once it completes; JobFailedError if it ends dead or
    cancelled; TimeoutError after ``timeout`` seconds (None waits for ever)."""
    deadline = _Deadline(job_id, timeout)
    with psycopg.connect(app.database_url, autocommit=True, prepare_threshold=None) as conn:
        conn.execute(_listen(app.schema))
        while True:
            job = client.get_job(conn, app.schema, job_id)
            if _settled(job):
                return job.result
            for _ in conn.notifies(timeout=deadline.next_wait(), stop_after=1):
                pass


async def wait_for_result_async(app: App, job_id: int, timeout: float | None = None) -> Any:
    """Async twin of ``wait_for_result``."""
    deadline = _Deadline(job_id, timeout)
    async with await psycopg.AsyncConnection.connect(
        app.database_url, autocommit=True, prepare_threshold=None
    ) as conn:
        await conn.execute(_listen(app.schema))
        while True:
            job = await client.get_job_async(conn, app.schema, job_id)
            if _settled(job):
                return job.result
            async for _ in conn.notifies(timeout=deadline.next_wait(), stop_after=1):
                pass


class JobRef(int):
    """A job id (it is an int) that can also wait for the job's result. ``duplicate`` is
    True when a live job already held the unique key: this is that job."""

    app: App
    duplicate: bool

    def __new__(cls, job_id: int, app: App, *, duplicate: bool = False) -> JobRef:
        ref = super().__new__(cls, job_id)
        ref.app = app
        ref.duplicate = duplicate
        return ref

    def result(self, timeout: float | None = None) -> Any:
        return wait_for_result(self.app, int(self), timeout)

    async def result_async(self, timeout: float | None = None) -> Any:
        return await wait_for_result_async(self.app, int(self), timeout)
