"""The job a handler is running, for handlers that want its id or attempt number."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from skiplock.storable import problem_in, storable_json_text
from skiplock.types import ClaimedJob

_current: ContextVar[ClaimedJob | None] = ContextVar("skiplock_current_job", default=None)


class CancelFlag:
    """Set once, read from any thread. Lighter than threading.Event, of which only this
    much is needed: one is made for every job."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


_cancel: ContextVar[CancelFlag | None] = ContextVar("skiplock_cancel", default=None)
_progress: ContextVar[Callable[[str], None] | None] = ContextVar("skiplock_progress", default=None)
MAX_PROGRESS_BYTES = 64 * 1024


def current_job() -> ClaimedJob:
    """The job being run by this handler; raises outside a handler."""
    job = _current.get()
    if job is None:
        raise RuntimeError("skiplock.current_job() called outside a running job")
    return job


def current_job_or_none() -> ClaimedJob | None:
    """The job being run in this context, or None outside a handler."""
    return _current.get()


def cancel_requested() -> bool:
    """True once someone asked to cancel the running job (``skiplock jobs cancel``).

    Sync handlers cannot be interrupted: long ones should check this now and then and
    return (or raise) early. Async handlers are cancelled outright.
    """
    flag = _cancel.get()
    return flag is not None and flag.is_set()


def set_progress(value: Any) -> None:
    """Record how far the running job has got (a small JSON value, e.g. {"done": 40,
    "of": 100}); ``skiplock jobs show`` displays it. Written about once a second, the
    latest value wins; kept in history when the job finishes. For lease-mode handlers
    (sync or async); a transactional handler can write to its own tables instead."""
    sink = _progress.get()
    if sink is None:
        raise RuntimeError("skiplock.set_progress() called outside a running lease-mode job")
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"progress must be JSON: {exc}") from None
    if len(encoded) > MAX_PROGRESS_BYTES:
        raise ValueError(f"progress is {len(encoded)} bytes of JSON; keep it under 64 KiB")
    if not storable_json_text(encoded):
        # Refused here, in the handler: written later, it would fail a whole write.
        raise ValueError(f"progress not storable: {problem_in(value)}")
    sink(encoded)


def set_current_job(
    job: ClaimedJob | None,
    cancel: CancelFlag | None = None,
    progress: Callable[[str], None] | None = None,
) -> None:
    _current.set(job)
    _cancel.set(cancel)
    _progress.set(progress)
