"""What one attempt of a job came to: a closed set of types, each written by one statement.

``Completed``, ``Retried``, ``Dead``, ``Snoozed`` and ``Cancelled`` are the outcomes a
worker writes; ``Suspended`` (a wait or a sleep) is written by the handler itself
(``Outcome`` is their union). Each says which statement writes it
(``statements``, of its ``group``) and what it puts in that statement's batch
(``entry``); a transactional
attempt's outcome is written by ``locked_write``. A failed attempt, retried or dead, is
written by the one failure statement, whose entry says which: a flush with both costs
one statement, not two.

Every outcome carries the same readers (``kind``, ``error``, ``dead``, ``delay``,
``cancelled``, ``result_json``), so that logs, metrics and spans read any of them alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from skiplock.sql import complete, render

# The statement families of lease-mode outcomes: each batch statement (fenced, in the
# flush's transaction) and its twin that commits alone (sql/complete.py).
COMPLETE = (complete.JOB_COMPLETE_MANY_IF_LEASED, complete.JOB_COMPLETE_MANY_ALONE)
FAIL = (complete.JOB_FAIL_MANY_IF_LEASED, complete.JOB_FAIL_MANY_ALONE)
SNOOZE = (complete.JOB_SNOOZE_MANY_IF_LEASED, complete.JOB_SNOOZE_MANY_ALONE)
CANCEL = (complete.JOB_CANCEL_MANY_IF_LEASED, complete.JOB_CANCEL_MANY_ALONE)


@dataclass(frozen=True, slots=True)
class Completed:
    """The handler returned; ``result_json`` is its encoded return value (None: none)."""

    job_id: int
    attempt: int
    result_json: str | None = None
    # The handler's latest set_progress() not yet written: it goes in with the outcome.
    progress_json: str | None = None
    # The handler completed the job in its own transaction (skiplock.complete): a
    # write that matches no row is that, not a lost lease.
    by_handler: bool = False

    kind: ClassVar[str] = "completed"
    group: ClassVar[str] = "completed"
    statements: ClassVar[tuple[str, str]] = COMPLETE
    error: ClassVar[None] = None
    dead: ClassVar[bool] = False
    delay: ClassVar[float] = 0.0
    cancelled: ClassVar[bool] = False

    def entry(self) -> dict[str, Any]:
        # A value left out reads as NULL (->>), as JSON null does: less to encode, send
        # and parse for the progress and result most outcomes do not have.
        entry: dict[str, Any] = {"attempt": self.attempt}
        if self.progress_json is not None:
            entry["progress"] = self.progress_json
        if self.result_json is not None:
            entry["result"] = self.result_json
        return entry


@dataclass(frozen=True, slots=True)
class _Failed:
    """A failed attempt (``error`` is its record): the one failure statement writes both
    kinds, its entry saying which."""

    job_id: int
    attempt: int
    error: dict[str, Any]
    # Retried: the job runs again this many seconds on. Dead: the back-off the retry
    # policy gave, kept as the row's retry_at as before.
    delay: float = 0.0
    progress_json: str | None = None

    kind: ClassVar[str]
    dead: ClassVar[bool]
    group: ClassVar[str] = "failed"
    result_json: ClassVar[None] = None
    statements: ClassVar[tuple[str, str]] = FAIL
    cancelled: ClassVar[bool] = False

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "attempt": self.attempt,
            "dead": self.dead,
            "delay": self.delay,
            "error": self.error,
        }
        if self.progress_json is not None:
            entry["progress"] = self.progress_json
        return entry


@dataclass(frozen=True, slots=True)
class Retried(_Failed):
    """The attempt failed; the job runs again ``delay`` s on."""

    kind: ClassVar[str] = "retried"
    dead: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class Dead(_Failed):
    """The attempt failed and was the last one the job gets."""

    kind: ClassVar[str] = "dead"
    dead: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Snoozed:
    """The handler raised Snooze: the job waits ``delay`` s, the attempt uncounted."""

    job_id: int
    attempt: int
    delay: float = 0.0
    progress_json: str | None = None

    kind: ClassVar[str] = "snoozed"
    group: ClassVar[str] = "snoozed"
    result_json: ClassVar[None] = None
    statements: ClassVar[tuple[str, str]] = SNOOZE
    error: ClassVar[None] = None
    dead: ClassVar[bool] = False
    cancelled: ClassVar[bool] = False

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"attempt": self.attempt, "delay": self.delay}
        if self.progress_json is not None:
            entry["progress"] = self.progress_json
        return entry


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The job was asked to stop while it ran, and it did."""

    job_id: int
    attempt: int
    progress_json: str | None = None

    kind: ClassVar[str] = "cancelled"
    group: ClassVar[str] = "cancelled"
    result_json: ClassVar[None] = None
    statements: ClassVar[tuple[str, str]] = CANCEL
    error: ClassVar[None] = None
    dead: ClassVar[bool] = False
    delay: ClassVar[float] = 0.0
    cancelled: ClassVar[bool] = True

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"attempt": self.attempt}
        if self.progress_json is not None:
            entry["progress"] = self.progress_json
        return entry


@dataclass(frozen=True, slots=True)
class Suspended:
    """The job waits for a signal (``kind`` "waiting") or sleeps ("sleeping"): the handler
    wrote that itself, fenced (skiplock.wait_for, skiplock.sleep), and the worker writes
    nothing more for the attempt."""

    job_id: int
    attempt: int
    kind: str = "waiting"
    progress_json: str | None = None

    group: ClassVar[str] = "suspended"
    result_json: ClassVar[None] = None
    error: ClassVar[None] = None
    dead: ClassVar[bool] = False
    delay: ClassVar[float] = 0.0
    cancelled: ClassVar[bool] = False

    def entry(self) -> dict[str, Any]:
        return {"attempt": self.attempt}


# What a worker writes, and every outcome.
Written = Completed | Retried | Dead | Snoozed | Cancelled
Outcome = Written | Suspended
Failed = Retried | Dead
# Every outcome type a worker writes, for code that must handle each (a Suspended
# outcome was written by its handler).
OUTCOME_TYPES: tuple[type[Written], ...] = (Completed, Retried, Dead, Snoozed, Cancelled)


def failed(job_id: int, attempt: int, error: dict[str, Any], *, dead: bool, delay: float) -> Failed:
    """A failed attempt: dead, or retried after ``delay`` seconds."""
    if dead:
        return Dead(job_id, attempt, error, delay)
    return Retried(job_id, attempt, error, delay)


def locked_write(schema: str, outcome: Outcome) -> tuple[str, dict[str, Any]]:
    """The statement and parameters writing a transactional attempt's outcome: its row is
    locked by the batch's own transaction (sql/complete.py, *_LOCKED)."""
    if isinstance(outcome, Completed):
        statement = complete.JOB_COMPLETE_LOCKED
        return render(statement, schema), {"id": outcome.job_id, "result": outcome.result_json}
    if isinstance(outcome, Snoozed):
        return render(complete.JOB_SNOOZE_LOCKED, schema), {
            "id": outcome.job_id,
            "delay": outcome.delay,
        }
    if isinstance(outcome, Retried | Dead):
        return render(complete.JOB_FAIL_LOCKED, schema), {
            "id": outcome.job_id,
            "dead": outcome.dead,
            "delay": outcome.delay,
            "error": json.dumps(outcome.error),
        }
    raise ValueError(f"a transactional attempt does not end {outcome.kind}")
