"""Batches: jobs added in any number of transactions, and a callback that runs once, after
the batch is closed and every job in it has ended (decision 025).

    batch = app.batch(on_finish=summary.job(day=d))
    batch.add(conn, [resize.job(photo=p) for p in photos])   # in conn's transaction
    app.batch_by_id(batch.id).add(other, more)               # later, elsewhere
    batch.close(conn)                                        # no more jobs; the callback may run

A batch is a workflow (decision 024) whose first step is the callback, run whatever its
jobs end as. Inside it, ``batch_counts()`` says how many completed, ended dead or were
cancelled. The building of parameters is pure; the sync and async shells only execute.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from skiplock.client.params import SCHEMA_MISSING, schema_not_ready
from skiplock.errors import ConfigurationError, EnqueueError
from skiplock.results import JobRef
from skiplock.sql import render
from skiplock.sql import workflows as statements
from skiplock.tasks import JobSpec
from skiplock.workflow import (
    MAX_STEPS,
    _check_text,
    _Node,
    running_step_rows,
    running_step_rows_async,
    step_columns,
)

if TYPE_CHECKING:
    from skiplock.app import App

CALLBACK_STEP = "on_finish"


@dataclass(frozen=True)
class BatchCounts:
    """How a batch's jobs ended."""

    completed: int
    dead: int
    cancelled: int

    @property
    def total(self) -> int:
        return self.completed + self.dead + self.cancelled


def _check_job(job: object, what: str) -> JobSpec:
    if not isinstance(job, JobSpec):
        raise ConfigurationError(f"{what} is a job from task.job(...), got {type(job).__name__}")
    if job.unique_key is not None:
        raise ConfigurationError(
            f"{what}: unique jobs cannot join a batch (a duplicate would make another job "
            "part of it); drop unique for this call"
        )
    return job


class Batch:
    """An open batch of ``app``'s jobs. Nothing is written until the first ``add`` or
    ``close``, which writes the batch (and its callback, waiting) in that connection's
    transaction; ``id`` is known from then on."""

    def __init__(
        self,
        app: App,
        on_finish: JobSpec | None,
        *,
        name: str | None = None,
        batch_id: int | None = None,
    ) -> None:
        if batch_id is None:
            if on_finish is None:
                raise ConfigurationError("a new batch needs its callback: on_finish=task.job()")
            _check_job(on_finish, "on_finish")
        if name is not None:
            _check_text("batch name", name)
        self.app = app
        self.on_finish = on_finish
        self.name = name
        self.id = batch_id

    def __repr__(self) -> str:
        return f"<Batch {self.id if self.id is not None else '(not written yet)'}>"

    # -- statements and their parameters (pure) -------------------------------------------

    def _create(self) -> tuple[str, dict[str, Any]]:
        assert self.on_finish is not None
        node = _Node(self.on_finish, CALLBACK_STEP, (), True, True)
        given = step_columns([node], run_anyway=True)
        given["w"] = [1]  # the close: the callback waits for it as for a parent
        params = {
            "name": self.name,
            "options": json.dumps({"run_anyway": True, "batch": True, "open": True}),
            "steps": 1,
            "given": json.dumps(given),
            "meta": None,
        }
        return render(statements.WORKFLOW_INSERT, self.app.schema), params

    def _add(self, jobs: Sequence[JobSpec]) -> tuple[str, dict[str, Any]]:
        nodes = [_Node(job, job.task, (), False, False) for job in jobs]
        params = {
            "batch": self.id,
            "steps": len(nodes),
            "given": json.dumps(step_columns(nodes, run_anyway=False)),
        }
        return render(statements.BATCH_ADD, self.app.schema), params

    def _jobs(self, jobs: Iterable[JobSpec] | JobSpec) -> list[JobSpec]:
        listed = [jobs] if isinstance(jobs, JobSpec) else list(jobs)
        if len(listed) > MAX_STEPS:
            raise ConfigurationError(
                f"add at most {MAX_STEPS:,} jobs to a batch at a time; call add again"
            )
        return [_check_job(job, f"job {i}") for i, job in enumerate(listed)]

    def _created(self, row: Sequence[Any] | None) -> None:
        assert row is not None
        self.id = int(row[0])

    def _refs(self, row: Sequence[Any] | None, count: int) -> list[JobRef]:
        assert row is not None
        ids, written = row
        if written != count:  # pragma: no cover
            raise RuntimeError(f"{count} jobs added to a batch wrote {written}")
        return [JobRef(int(i), self.app) for i in ids or ()]

    # -- the shells ---------------------------------------------------------------------

    def add(self, conn: psycopg.Connection[Any], jobs: Iterable[JobSpec] | JobSpec) -> list[JobRef]:
        """Add ``jobs`` in ``conn``'s transaction (never commits). EnqueueError if the
        batch is closed or does not exist. Until that transaction ends, the completions
        of this batch's jobs wait for it."""
        listed = self._jobs(jobs)
        try:
            if self.id is None:
                self._created(conn.execute(*self._create()).fetchone())
            if not listed:
                return []
            return self._refs(conn.execute(*self._add(listed)).fetchone(), len(listed))
        except SCHEMA_MISSING as exc:
            raise schema_not_ready(self.app.schema, exc) from exc
        except psycopg.errors.ObjectNotInPrerequisiteState as exc:
            raise EnqueueError(_first_line(exc)) from None

    async def add_async(
        self, conn: psycopg.AsyncConnection[Any], jobs: Iterable[JobSpec] | JobSpec
    ) -> list[JobRef]:
        """``add`` on an async connection."""
        listed = self._jobs(jobs)
        try:
            if self.id is None:
                self._created(await (await conn.execute(*self._create())).fetchone())
            if not listed:
                return []
            cur = await conn.execute(*self._add(listed))
            return self._refs(await cur.fetchone(), len(listed))
        except SCHEMA_MISSING as exc:
            raise schema_not_ready(self.app.schema, exc) from exc
        except psycopg.errors.ObjectNotInPrerequisiteState as exc:
            raise EnqueueError(_first_line(exc)) from None

    def close(self, conn: psycopg.Connection[Any]) -> bool:
        """No job can be added any more; the callback runs once every job added has ended
        (at once if they all have), after ``conn``'s transaction commits. False if the
        batch was closed already."""
        try:
            if self.id is None:
                self._created(conn.execute(*self._create()).fetchone())
            row = conn.execute(*self._close()).fetchone()
        except SCHEMA_MISSING as exc:
            raise schema_not_ready(self.app.schema, exc) from exc
        except psycopg.errors.ObjectNotInPrerequisiteState as exc:
            raise EnqueueError(_first_line(exc)) from None
        return bool(row and row[0])

    async def close_async(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """``close`` on an async connection."""
        try:
            if self.id is None:
                self._created(await (await conn.execute(*self._create())).fetchone())
            row = await (await conn.execute(*self._close())).fetchone()
        except SCHEMA_MISSING as exc:
            raise schema_not_ready(self.app.schema, exc) from exc
        except psycopg.errors.ObjectNotInPrerequisiteState as exc:
            raise EnqueueError(_first_line(exc)) from None
        return bool(row and row[0])

    def _close(self) -> tuple[str, dict[str, Any]]:
        return render(statements.BATCH_CLOSE, self.app.schema), {"batch": self.id}


def _first_line(exc: psycopg.Error) -> str:
    return str(exc).strip().splitlines()[0]


def _counts(rows: Sequence[Sequence[Any]]) -> BatchCounts:
    found = {str(outcome): int(count) for outcome, count in rows if outcome is not None}
    return BatchCounts(found.get("completed", 0), found.get("dead", 0), found.get("cancelled", 0))


def batch_counts(conn: psycopg.Connection[Any] | None = None) -> BatchCounts:
    """Inside a batch's callback: how its jobs ended, read from the database (``conn``,
    or a short connection of the callback's App). All zero in a job that is no callback."""
    return _counts(running_step_rows(statements.BATCH_COUNTS, conn))


async def batch_counts_async(conn: psycopg.AsyncConnection[Any] | None = None) -> BatchCounts:
    """``batch_counts`` for async callbacks."""
    return _counts(await running_step_rows_async(statements.BATCH_COUNTS, conn))
