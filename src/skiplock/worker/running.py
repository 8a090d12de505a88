"""The lease-mode jobs a worker process holds, one ``RunningJob`` each, in one registry.

A job is held from its claim until its task ends: it may first wait for a run permit
(claimed ahead of free capacity), then run, and it leaves by finishing, by being given
back unstarted, by losing its lease, or by being cut short at shutdown. ``RunningJobs``
has one method per such transition, so that what is known about a job lives in one
place and each change to it is made in one place.

Everything here runs on the worker's event loop, but for ``RunningJob.report_progress``,
which handler threads call: one attribute assignment, atomic under the GIL.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from skiplock.context import CancelFlag
from skiplock.types import ClaimedJob

# Numbers each progress report, across jobs: a report is written once, however the
# heartbeat's reads and a handler's reports interleave. next() on a count is atomic.
_reports = itertools.count(1)


@dataclass
class ClaimTimes:
    """When a claim was asked, and when its jobs were registered (its answer read), in
    monotonic seconds: what a later heartbeat confirms about them depends on both."""

    asked_at: float
    registered_at: float = math.inf


class RunningJob:
    """One claimed attempt of a job, held by this worker from its claim to its end."""

    __slots__ = (
        "_progress",
        "_progress_taken",
        "attempt",
        "began",
        "cancel",
        "claim",
        "completed_by_handler",
        "given_back",
        "held",
        "id",
        "job",
        "started_at",
        "task",
        "waiting_since",
    )

    def __init__(self, job: ClaimedJob, claim: ClaimTimes) -> None:
        self.job = job
        # The job's id and this attempt (the claim's token), read on every transition:
        # attributes, not properties, as the registry sits on the path of every job.
        self.id: int = job.id
        self.attempt: int = job.attempts
        self.claim = claim
        # Set by RunningJobs.claimed, at once.
        self.task: asyncio.Task[None] = None  # type: ignore[assignment]
        # What skiplock.cancel_requested() reads inside the handler.
        self.cancel = CancelFlag()
        # Its task has taken its first step: a cancellation now reaches its cleanup.
        self.began = False
        # Loop time since when it waits for a run permit (claimed ahead), or None.
        self.waiting_since: float | None = None
        # Loop time its handler was called, or None before.
        self.started_at: float | None = None
        # Given back unstarted: its task ends without an outcome.
        self.given_back = False
        # Its handler completed it in its own transaction (skiplock.complete): the row
        # is gone, or about to go, and that is no lost lease.
        self.completed_by_handler = False
        # Still the attempt of its job this worker holds (kept by RunningJobs): read as an
        # attribute, on the path of every job.
        self.held = True
        self._progress: tuple[int, str] | None = None
        self._progress_taken = 0

    def completing(self) -> None:
        """Its handler completed it (``skiplock.complete``), from any thread."""
        self.completed_by_handler = True

    def report_progress(self, encoded: str) -> None:
        """The handler's latest ``set_progress`` (from any thread): the last one wins."""
        self._progress = (next(_reports), encoded)

    def take_progress(self) -> str | None:
        """The progress reported since the last take, if any."""
        report = self._progress
        if report is None or report[0] <= self._progress_taken:
            return None
        self._progress_taken = report[0]
        return report[1]

    def __repr__(self) -> str:
        return f"<RunningJob {self.id} attempt {self.attempt} of {self.job.task}>"


class RunningJobs:
    """The jobs this worker holds, by id; those waiting for a run permit, oldest first."""

    def __init__(self) -> None:
        self._held: dict[int, RunningJob] = {}
        self._waiting: dict[int, RunningJob] = {}

    # -- transitions ----------------------------------------------------------------------

    def claimed(
        self,
        job: ClaimedJob,
        claim: ClaimTimes,
        run: Callable[[RunningJob], Coroutine[Any, Any, None]],
    ) -> RunningJob:
        """A claim brought ``job``: it is held from now on, run by a task of its own
        (``run``). A job given back and claimed again replaces its former attempt here."""
        entry = RunningJob(job, claim)
        entry.task = asyncio.create_task(run(entry))
        former = self._held.get(job.id)
        if former is not None:
            former.held = False
        self._held[job.id] = entry
        return entry

    def began(self, entry: RunningJob) -> None:
        """``entry``'s task has taken its first step."""
        entry.began = True

    def claimed_ahead(self, entry: RunningJob, now: float) -> None:
        """``entry`` was claimed ahead and waits for a run permit from ``now`` (loop time)."""
        entry.waiting_since = now
        self._waiting[entry.id] = entry

    def permitted(self, entry: RunningJob) -> None:
        """``entry`` stopped waiting for a permit (got one, or its wait was cut short)."""
        entry.waiting_since = None
        if self._waiting.get(entry.id) is entry:
            del self._waiting[entry.id]

    def started(self, entry: RunningJob, now: float) -> None:
        """``entry``'s handler is being called (at ``now``, loop time)."""
        entry.started_at = now

    def cancelled(self, job_id: int) -> RunningJob | None:
        """A cancellation was asked for ``job_id``: its flag is set, and the job returned,
        when it is held here, its task has begun and it was not asked before."""
        entry = self._held.get(job_id)
        if entry is None or not entry.began or entry.cancel.is_set():
            return None
        entry.cancel.set()
        return entry

    def finished(self, entry: RunningJob) -> None:
        """``entry``'s task ended, whatever way. A newer claim of the same job is left be."""
        if entry.waiting_since is not None:  # waiting (claimed_ahead) until permitted
            self.permitted(entry)
        if entry.held:
            entry.held = False
            del self._held[entry.id]

    def give_back(self, job_ids: list[int] | None = None) -> list[RunningJob]:
        """Take the jobs of ``job_ids`` (or every one) that still wait for a permit off the
        registry, marked given back: they will not start. Returns them."""
        chosen = list(self._waiting) if job_ids is None else job_ids
        taken: list[RunningJob] = []
        for job_id in chosen:
            entry = self._waiting.pop(job_id, None)
            if entry is None:
                continue  # it got its permit meanwhile: it is starting
            entry.waiting_since = None
            entry.given_back = True
            if entry.held:
                entry.held = False
                del self._held[job_id]
            taken.append(entry)
        return taken

    def lease_lost(self, entry: RunningJob) -> bool:
        """The database no longer holds ``entry`` for this worker (or the worker lets it
        go, cut short at shutdown): it leaves the registry. False if it had left already."""
        self.permitted(entry)
        if not entry.held:
            return False
        entry.held = False
        del self._held[entry.id]
        return True

    # -- reading --------------------------------------------------------------------------

    def get(self, job_id: int) -> RunningJob | None:
        return self._held.get(job_id)

    def attempt_of(self, job_id: int) -> int | None:
        """The attempt of ``job_id`` held here, or None."""
        entry = self._held.get(job_id)
        return None if entry is None else entry.attempt

    def snapshot(self) -> dict[int, RunningJob]:
        """The jobs held now, by id: a copy, for a reader that awaits while it works."""
        return dict(self._held)

    def waiting(self) -> list[int]:
        """The jobs waiting for a run permit, oldest first."""
        return list(self._waiting)

    def oldest_wait(self) -> float | None:
        """Since when (loop time) the job waiting longest has waited, or None."""
        for entry in self._waiting.values():
            return entry.waiting_since
        return None

    def waited_past(self, bound: float, now: float) -> list[int]:
        """The jobs that have waited for a permit ``bound`` seconds or more, oldest first."""
        overdue: list[int] = []
        for job_id, entry in self._waiting.items():
            since = entry.waiting_since
            if since is None or now - since < bound:
                break
            overdue.append(job_id)
        return overdue

    def running_longer_than(self, bound: float, now: float) -> int:
        """Jobs whose handler was called more than ``bound`` seconds before ``now``."""
        return sum(
            1
            for entry in self._held.values()
            if entry.started_at is not None and now - entry.started_at > bound
        )

    def take_progress(self) -> dict[int, tuple[int, str]]:
        """Progress reported since the last take: job id -> (attempt, encoded value)."""
        taken: dict[int, tuple[int, str]] = {}
        for entry in list(self._held.values()):
            encoded = entry.take_progress()
            if encoded is not None:
                taken[entry.id] = (entry.attempt, encoded)
        return taken

    @property
    def running(self) -> int:
        """Jobs held whose handler runs (or is about to): not those waiting for a permit."""
        return len(self._held) - len(self._waiting)

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[RunningJob]:
        return iter(list(self._held.values()))
