"""The job's vocabulary: states and the frozen row a handler's job is read into."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


class JobState(enum.StrEnum):
    """One vocabulary for SQL, Python, CLI and docs.

    ``waiting`` jobs are workflow steps waiting for their parents (decision 024);
    ``blocked`` jobs wait for their key's turn (ordering and concurrency keys);
    ``scheduled`` and ``retryable`` jobs wait for their ``run_at``; the promoter then makes
    them ``available``. ``completed`` and ``cancelled`` live in the history table; the rest
    in the hot table.
    """

    WAITING = "waiting"
    BLOCKED = "blocked"
    SCHEDULED = "scheduled"
    AVAILABLE = "available"
    RUNNING = "running"
    RETRYABLE = "retryable"
    DEAD = "dead"
    COMPLETED = "completed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


# The states of rows in the jobs table (the others are in history), in a job's order.
LIVE_STATES: tuple[str, ...] = tuple(
    state.value for state in JobState if state not in (JobState.COMPLETED, JobState.CANCELLED)
)

# What a workflow is in (migration 0022's workflows.state): running until its last step ends.
WORKFLOW_STATES = ("running", "completed", "failed", "cancelled")

JsonDict = dict[str, Any]


@dataclass(frozen=True)
class Job:
    """A job row as it was read; never updated in place."""

    id: int
    queue: str
    task: str
    args: JsonDict
    state: JobState
    priority: int
    run_at: datetime
    retry_at: datetime | None
    attempts: int
    max_attempts: int
    errors: list[JsonDict]
    worker_id: UUID | None
    lease_expires_at: datetime | None
    created_at: datetime
    attempted_at: datetime | None
    finished_at: datetime | None = None
    result: Any = None
    progress: Any = None
    cancel_requested_at: datetime | None = None
    # A job waiting for a signal (skiplock.wait_for): its key, and when its wait times out.
    wait_key: str | None = None
    wait_until: datetime | None = None
    tags: tuple[str, ...] = ()

    @property
    def last_error(self) -> str | None:
        """The message of the most recent failure, if any."""
        if not self.errors:
            return None
        last = self.errors[-1]
        return f"{last.get('type', 'Error')}: {last.get('message', '')}"


@dataclass(frozen=True)
class ClaimedJob:
    """The part of a job row a worker needs to run it.

    In lease mode ``attempts`` already counts this attempt (the claim increments it) and is
    the fencing token; in transactional mode it counts earlier attempts only.
    """

    id: int
    queue: str
    task: str
    args: JsonDict
    priority: int
    run_at: datetime
    attempts: int
    max_attempts: int
    created_at: datetime
    # Set when the row's arguments could not be decoded: the job fails with this message.
    args_error: str | None = None
    # The row's meta (0017) as JSON text, undecoded: read only by a tracer (tracing.py).
    meta: str | None = None
