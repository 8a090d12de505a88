"""One stream of job events: what happens to a job in a worker, told once, to whoever
subscribes.

A worker emits each transition of a job once, on either path (lease mode or a
transactional batch), into its ``EventStream``; the job log, the worker's stats and the
metrics subscribe to it. A subscriber implements ``JobEvents`` (subclassing ``NoEvents``
to keep only the events it wants).

The transitions:

- ``claimed``: a claim brought jobs (``count``; ``jobs`` lists a lease-mode claim's,
  while a transactional batch's jobs are told as they end);
- ``started``: an attempt's handler is called (``ago`` seconds ago, when told after the
  fact, as a transactional batch does);
- ``ended``: the attempt came to an outcome; its type (outcomes.py) says which:
  ``Completed`` (succeeded), ``Retried`` or ``Dead`` (failed: ``outcome.error`` is the
  record stored), ``Snoozed`` or ``Cancelled``;
- ``given_back``: jobs claimed ahead went back to their queues unstarted;
- ``lost``: an attempt this worker held is no longer its own (its lease was lost, or the
  job was given back and claimed again); no outcome of it is written.

Every event is told on the worker's event loop, in the job's own task where there is
one, and must not block: a subscriber that does I/O hands it off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from skiplock.outcomes import Outcome
from skiplock.types import ClaimedJob


class JobEvents(Protocol):
    """What a subscriber to the job events implements."""

    def claimed(self, queue: str, count: int, jobs: Sequence[ClaimedJob]) -> None: ...

    def started(self, job: ClaimedJob, attempt: int, ago: float) -> None: ...

    def ended(self, job: ClaimedJob, outcome: Outcome, seconds: float) -> None: ...

    def given_back(self, count: int) -> None: ...

    def lost(self, job: ClaimedJob, attempt: int) -> None: ...


class NoEvents:
    """A subscriber that does nothing with any event: the base of those that want a few."""

    def claimed(self, queue: str, count: int, jobs: Sequence[ClaimedJob]) -> None:
        return None

    def started(self, job: ClaimedJob, attempt: int, ago: float) -> None:
        return None

    def ended(self, job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
        return None

    def given_back(self, count: int) -> None:
        return None

    def lost(self, job: ClaimedJob, attempt: int) -> None:
        return None


class EventStream:
    """The events of one worker, told to each subscriber in the order they subscribed.

    Each event calls only the subscribers that implement it (a method not inherited from
    NoEvents): with none, telling it costs a loop over nothing."""

    def __init__(self, *subscribers: JobEvents) -> None:
        self._subscribers: tuple[JobEvents, ...] = ()
        self._claimed: tuple[Callable[[str, int, Sequence[ClaimedJob]], None], ...] = ()
        self._started: tuple[Callable[[ClaimedJob, int, float], None], ...] = ()
        self._ended: tuple[Callable[[ClaimedJob, Outcome, float], None], ...] = ()
        self._given_back: tuple[Callable[[int], None], ...] = ()
        self._lost: tuple[Callable[[ClaimedJob, int], None], ...] = ()
        for subscriber in subscribers:
            self.subscribe(subscriber)

    def subscribe(self, subscriber: JobEvents) -> None:
        self._subscribers = (*self._subscribers, subscriber)

        def wants(name: str) -> bool:
            return getattr(type(subscriber), name, None) is not getattr(NoEvents, name)

        if wants("claimed"):
            self._claimed = (*self._claimed, subscriber.claimed)
        if wants("started"):
            self._started = (*self._started, subscriber.started)
        if wants("ended"):
            self._ended = (*self._ended, subscriber.ended)
        if wants("given_back"):
            self._given_back = (*self._given_back, subscriber.given_back)
        if wants("lost"):
            self._lost = (*self._lost, subscriber.lost)

    def claimed(self, queue: str, count: int, jobs: Sequence[ClaimedJob] = ()) -> None:
        for claimed in self._claimed:
            claimed(queue, count, jobs)

    def started(self, job: ClaimedJob, attempt: int, ago: float = 0.0) -> None:
        for started in self._started:
            started(job, attempt, ago)

    def ended(self, job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
        for ended in self._ended:
            ended(job, outcome, seconds)

    def given_back(self, count: int) -> None:
        for given_back in self._given_back:
            given_back(count)

    def lost(self, job: ClaimedJob, attempt: int) -> None:
        for lost in self._lost:
            lost(job, attempt)
