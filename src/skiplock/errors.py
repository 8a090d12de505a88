"""Errors raised by skiplock, and the exceptions a handler raises to steer its own job."""

from __future__ import annotations

from datetime import datetime, timedelta


class SkiplockError(Exception):
    """Base class of every error skiplock raises."""


class ConfigurationError(SkiplockError):
    """A setting, task option or connection target is wrong; the message names the fix."""


class SchemaNotReadyError(SkiplockError):
    """The database schema is missing or behind this version of skiplock."""


class EnqueueError(SkiplockError, ValueError):
    """A job could not be enqueued: arguments or options are invalid. Nothing was written."""


class UnknownTaskError(SkiplockError, LookupError):
    """A job names a task that this app has not registered."""


class JobNotFoundError(SkiplockError, LookupError):
    """No live job has that id (it may have finished and moved to history)."""


class ScheduleNotFoundError(SkiplockError, LookupError):
    """No cron schedule of that name has been ticked by a worker (skiplock cron list)."""


class JobFailedError(SkiplockError):
    """A job whose result was awaited ended dead or cancelled instead of completed."""


class ResultNotStorableError(SkiplockError, ValueError):
    """A handler returned a value PostgreSQL cannot store (a NUL or a lone surrogate in a
    string, inf or nan): the attempt fails with this error, its message says where."""


class OutcomeNotStorableError(SkiplockError):
    """An attempt's outcome could not be turned into a write, or the write was refused
    for that row alone (skiplock.storable, completer): recorded as a failed attempt."""


class Snooze(Exception):  # noqa: N818 - raised by handlers; reads as an instruction
    """Raise from a handler to put its job back for ``after`` without using an attempt.

    For "not yet" rather than "failed": waiting on a resource, a rate limit, a window.
    The job goes to the back of its queue once the delay has passed.
    """

    def __init__(self, after: float | timedelta | datetime) -> None:
        super().__init__(f"snoozed for {after}")
        self.after = _aware(after, "Snooze")


class WaitTimeout(SkiplockError):  # noqa: N818 - reads as what happened, as TimeoutError
    """``skiplock.wait_for`` saw no signal before its timeout. The timeout is recorded as
    the wait's answer: a later attempt of the job gets it again, at once."""


class AttemptSuspended(BaseException):
    """Ends a handler whose job now waits for a signal or sleeps (skiplock.wait_for,
    skiplock.sleep): its row left the worker already. A BaseException, so that a handler's
    ``except Exception`` does not keep running an attempt that no longer holds its job."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Retry(Exception):  # noqa: N818 - raised by handlers; reads as an instruction
    """Raise from a handler to fail this attempt and run again after ``after``.

    Counts as an attempt: when attempts are exhausted the job is dead, as with any failure.
    ``after`` is a delay in seconds, a ``timedelta``, or an absolute ``datetime``.
    """

    def __init__(self, after: float | timedelta | datetime | None = None, reason: str = "") -> None:
        super().__init__(reason or "retry requested")
        self.after = _aware(after, "Retry")
        self.reason = reason


def _aware(
    after: float | timedelta | datetime | None, name: str
) -> float | timedelta | datetime | None:
    if isinstance(after, datetime) and after.tzinfo is None:
        raise ValueError(
            f"{name}(after=...) got a naive datetime ({after}); give a timezone-aware one, "
            "e.g. datetime.now(timezone.utc) + timedelta(minutes=5), or seconds"
        )
    return after
