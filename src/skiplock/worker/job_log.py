"""What a worker says about each job, on the ``skiplock.jobs`` logger.

Failed attempts at WARNING and dead jobs at ERROR, always: task, job id, attempt/max and
the exception, its traceback at the first and the last attempt only (the job's errors
keep every one). Claims, completions and the other outcomes at INFO, which
``skiplock worker -v`` turns on. A job that succeeds costs an ``isEnabledFor`` check.
Records carry ``job_id``, ``task``, ``queue`` and ``attempt`` for handlers that format
fields. ``JobLog`` is the subscriber to the worker's job events (events.py) that says it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from skiplock.events import NoEvents
from skiplock.outcomes import Outcome
from skiplock.types import ClaimedJob

jobs_log = logging.getLogger("skiplock.jobs")


def fields(job: ClaimedJob, attempt: int) -> dict[str, Any]:
    return {"job_id": job.id, "task": job.task, "queue": job.queue, "attempt": attempt}


def jobs_logged() -> bool:
    """Whether claims and completions are logged (checked once per claim or job)."""
    return jobs_log.isEnabledFor(logging.INFO)


def claimed(job: ClaimedJob) -> None:
    jobs_log.info(
        "job %s (%s) claimed from %s, attempt %d/%d",
        *(job.id, job.task, job.queue, job.attempts, job.max_attempts),
        extra=fields(job, job.attempts),
    )


def finished(job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
    """An attempt's outcome, of either path (``outcome.attempt`` is the attempt's number)."""
    if outcome.error is not None:
        failed(job, outcome)
    elif jobs_log.isEnabledFor(logging.INFO):
        jobs_log.info(
            "job %s (%s) %s in %.3fs, attempt %d/%d",
            *(job.id, job.task, outcome.kind, seconds, outcome.attempt, job.max_attempts),
            extra=fields(job, outcome.attempt),
        )


def failed(job: ClaimedJob, outcome: Outcome) -> None:
    error = outcome.error or {}
    attempt = outcome.attempt
    last = outcome.dead or attempt >= job.max_attempts
    then = "it is dead" if outcome.dead else f"retrying in {outcome.delay:.3g}s"
    traceback = error.get("traceback") if attempt == 1 or last else None
    jobs_log.log(
        logging.ERROR if outcome.dead else logging.WARNING,
        "job %s (%s) failed, attempt %d/%d: %s: %s; %s%s",
        *(job.id, job.task, attempt, job.max_attempts),
        error.get("type", "?"),
        error.get("message", ""),
        then,
        f"\n{traceback.rstrip()}" if traceback else "",
        extra=fields(job, attempt),
    )


class JobLog(NoEvents):
    """The job events, on the ``skiplock.jobs`` logger."""

    def claimed(self, queue: str, count: int, jobs: Sequence[ClaimedJob]) -> None:
        if jobs and jobs_logged():
            for job in jobs:
                claimed(job)

    def ended(self, job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
        finished(job, outcome, seconds)
