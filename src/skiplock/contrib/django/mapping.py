"""How skiplock's jobs read in the Tasks framework's terms, and back; pure.

Priority: Django's run from -100 to 100 with higher first, skiplock's are a smallint with
lower first; one is the other negated, so Django's default 0 is skiplock's default 0 and
Django jobs take their place among plain skiplock jobs.

States: waiting in any form (blocked, scheduled, available, and retryable, which is
"ready to be executed again") is READY; running is RUNNING; completed is SUCCESSFUL;
dead, and cancelled (which Django has no word for), are FAILED.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from skiplock import errors as skiplock_errors
from skiplock.types import JobState

# A workflow step waiting for its parents is READY too: it has not started, and will.
READY_STATES = frozenset(
    {
        JobState.WAITING,
        JobState.BLOCKED,
        JobState.SCHEDULED,
        JobState.AVAILABLE,
        JobState.RETRYABLE,
    }
)
FAILED_STATES = frozenset({JobState.DEAD, JobState.CANCELLED})
# Django's bounds (TASK_MIN_PRIORITY, TASK_MAX_PRIORITY), fixed by the framework.
DJANGO_PRIORITY_RANGE = (-100, 100)


def to_skiplock_priority(priority: int) -> int:
    """Django's priority (higher runs first) as skiplock's (lower runs first)."""
    return -int(priority)


def to_django_priority(priority: int) -> int:
    """skiplock's priority as Django's, clamped to Django's range (a job enqueued by
    other means may have any smallint)."""
    low, high = DJANGO_PRIORITY_RANGE
    return max(low, min(high, -int(priority)))


def status_name(state: str) -> str:
    """The TaskResultStatus value (READY, RUNNING, SUCCESSFUL, FAILED) of a job state."""
    job_state = JobState(state)
    if job_state in READY_STATES:
        return "READY"
    if job_state is JobState.RUNNING:
        return "RUNNING"
    if job_state is JobState.COMPLETED:
        return "SUCCESSFUL"
    return "FAILED"


def exception_path(record: Mapping[str, Any]) -> str:
    """The import path of a failure's exception class, from its error record.

    Records carry the class's module since 0016's release (executor.error_record). Older
    records, and those skiplock writes in SQL (WorkerLost, LeaseExpired, Cancelled,
    WorkerShutdown, which name an event rather than a class), have none: a builtin name
    is a builtin, anything else is named under skiplock.errors."""
    name = str(record.get("type") or "Exception")
    module = record.get("module")
    if module:
        return f"{module}.{name}"
    if isinstance(getattr(builtins, name, None), type):
        return f"builtins.{name}"
    return f"{skiplock_errors.__name__}.{name}"


def error_text(record: Mapping[str, Any]) -> str:
    """The traceback of a failure, or its type and message when none was kept."""
    traceback = record.get("traceback")
    if traceback:
        return str(traceback)
    return f"{record.get('type', 'Error')}: {record.get('message', '')}"


@dataclass(frozen=True)
class StoredCall:
    """A Django task's arguments as a job stores them: {"args": [...], "kwargs": {...}}."""

    args: list[Any]
    kwargs: dict[str, Any]

    def to_json_object(self) -> dict[str, Any]:
        return {"args": self.args, "kwargs": self.kwargs}

    @classmethod
    def from_json_text(cls, text: str) -> StoredCall:
        """The call stored in a job's arguments; a job enqueued by other means (a plain
        JSON object of named values) reads as keyword arguments."""
        decoded = json.loads(text)
        if not isinstance(decoded, dict):
            return cls([], {})
        if set(decoded) <= {"args", "kwargs"} and isinstance(decoded.get("args", []), list):
            kwargs = decoded.get("kwargs", {})
            if isinstance(kwargs, dict):
                return cls(list(decoded.get("args", [])), dict(kwargs))
        return cls([], decoded)


def failed_at(state: str, errors: Sequence[Mapping[str, Any]]) -> datetime | None:
    """When a dead job finished: its last failure (the jobs table has no finished_at)."""
    if JobState(state) is not JobState.DEAD or not errors:
        return None
    at = errors[-1].get("at")
    if not isinstance(at, str):
        return None
    try:
        return datetime.fromisoformat(at)
    except ValueError:
        return None
