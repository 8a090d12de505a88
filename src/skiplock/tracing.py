"""Where tracing hooks into the job's life: the send of an enqueue, the process of an attempt.

The engine knows only this interface; ``skiplock.contrib.otel`` implements it with
OpenTelemetry (the ``otel`` extra). ``App.tracing`` is None unless a tracer is installed,
and every hook site tests exactly that, once: with tracing off a job costs one attribute
read and nothing is imported.

What a tracer wants to carry from the enqueuing code to the attempt (a trace context) is
stored with the job in its ``meta`` column (migration 0017), never in its arguments,
which are checked against the handler's signature.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from skiplock.types import ClaimedJob


class Send(ABC):
    """One enqueue (or bulk enqueue) being traced."""

    # JSON object text for the jobs' meta column, or None to store nothing.
    meta_json: str | None = None

    @abstractmethod
    def sent(self, ids: Sequence[int], *, duplicate: bool = False) -> None:
        """The jobs are written (not committed: that is the caller's). ``duplicate``: a
        unique key's holder was returned instead of a new job."""


class Process(ABC):
    """One attempt being traced."""

    @abstractmethod
    def ended(self, outcome: str, error: Mapping[str, Any] | None) -> None:
        """The attempt's outcome word (completed, retried, dead, snoozed, cancelled) and,
        when it failed, the error record stored for it (executor.error_record)."""


class Tracing(ABC):
    """A tracer for enqueues and attempts. Each returns a context manager that is
    entered around the work, so that the span is current while it runs; an exception
    leaving it means the operation itself failed (an enqueue refused, a worker stopped)."""

    @abstractmethod
    def send(
        self, queue: str | None, task: str | None, count: int, *, batch: bool
    ) -> AbstractContextManager[Send]:
        """Around an enqueue of ``count`` jobs; ``queue`` and ``task`` are None when the
        jobs of a batch differ in them."""

    @abstractmethod
    def process(self, job: ClaimedJob, attempt: int) -> AbstractContextManager[Process]:
        """Around one attempt of ``job`` (its ``meta`` holds what ``send`` stored)."""

    def step(self, job: ClaimedJob, name: str, *, replayed: bool) -> AbstractContextManager[object]:
        """Around one durable step of the attempt (skiplock.step), inside its process;
        ``replayed``: answered from its record, not run. Nothing unless overridden."""
        return nullcontext()


def error_class(error: Mapping[str, Any]) -> str:
    """The exception class of a stored error record (executor.error_record), qualified by
    its module unless it is a builtin: what OpenTelemetry's error.type and the failures
    metric's label say."""
    name = str(error.get("type") or "Exception")
    module = error.get("module")
    return name if not module or module == "builtins" else f"{module}.{name}"
