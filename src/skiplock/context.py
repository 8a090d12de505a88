"""The job a handler is running, for handlers that want its id or attempt number."""

from __future__ import annotations

from contextvars import ContextVar

from skiplock.types import ClaimedJob

_current: ContextVar[ClaimedJob | None] = ContextVar("skiplock_current_job", default=None)


def current_job() -> ClaimedJob:
    """The job being run by this handler; raises outside a handler."""
    job = _current.get()
    if job is None:
        raise RuntimeError("skiplock.current_job() called outside a running job")
    return job


def set_current_job(job: ClaimedJob | None) -> None:
    _current.set(job)
