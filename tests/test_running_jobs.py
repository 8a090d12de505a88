"""The registry of lease-mode jobs a worker holds (worker/running.py): each transition
changes one job's entry, and a job given back and claimed again is two entries, of which
only the newer is held."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from skiplock.executor import claimed_from_row
from skiplock.types import ClaimedJob
from skiplock.worker.running import ClaimTimes, RunningJob, RunningJobs

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def job(job_id: int, attempt: int = 1) -> ClaimedJob:
    return claimed_from_row((job_id, "default", "t", "{}", 0, NOW, attempt, 3, NOW))


async def idle(entry: RunningJob) -> None:
    await asyncio.sleep(3600)


def scenario(body: Callable[[RunningJobs], Awaitable[None]]) -> None:
    async def main() -> None:
        jobs = RunningJobs()
        try:
            await body(jobs)
        finally:
            for entry in jobs:
                entry.task.cancel()

    asyncio.run(main())


def test_a_job_is_held_from_its_claim_until_it_finishes() -> None:
    async def body(jobs: RunningJobs) -> None:
        entry = jobs.claimed(job(1), ClaimTimes(0.0), idle)
        assert entry.held and jobs.attempt_of(1) == 1 and len(jobs) == 1
        assert jobs.running == 1
        jobs.started(entry, 10.0)
        assert jobs.running_longer_than(5.0, 16.0) == 1
        assert jobs.running_longer_than(5.0, 14.0) == 0
        jobs.finished(entry)
        assert not jobs and jobs.attempt_of(1) is None
        entry.task.cancel()

    scenario(body)


def test_a_job_claimed_again_is_not_let_go_when_its_former_attempt_ends() -> None:
    async def body(jobs: RunningJobs) -> None:
        former = jobs.claimed(job(1), ClaimTimes(0.0), idle)
        jobs.claimed_ahead(former, 1.0)
        assert [e.id for e in jobs.give_back([1])] == [1]
        assert former.given_back and not former.held
        newer = jobs.claimed(job(1), ClaimTimes(2.0), idle)
        jobs.claimed_ahead(newer, 3.0)
        jobs.finished(former)  # the former's task ends after the newer claim
        assert newer.held and jobs.waiting() == [1]
        assert not jobs.lease_lost(former)
        assert jobs.lease_lost(newer) and not jobs and jobs.waiting() == []
        former.task.cancel()
        newer.task.cancel()

    scenario(body)


def test_a_newer_claim_of_a_held_job_replaces_its_former_attempt() -> None:
    async def body(jobs: RunningJobs) -> None:
        former = jobs.claimed(job(1), ClaimTimes(0.0), idle)
        newer = jobs.claimed(job(1), ClaimTimes(1.0), idle)
        assert newer.held and not former.held and jobs.get(1) is newer
        jobs.finished(former)
        assert jobs.get(1) is newer and len(jobs) == 1
        assert not jobs.lease_lost(former)
        former.task.cancel()
        newer.task.cancel()

    scenario(body)


def test_only_jobs_still_waiting_for_a_permit_are_given_back_oldest_first() -> None:
    async def body(jobs: RunningJobs) -> None:
        entries = [jobs.claimed(job(n), ClaimTimes(0.0), idle) for n in (1, 2, 3, 4)]
        for at, entry in zip((1.0, 2.0, 3.0), entries[:3], strict=True):
            jobs.claimed_ahead(entry, at)
        jobs.permitted(entries[1])  # got its permit: it starts
        assert jobs.waiting() == [1, 3] and jobs.oldest_wait() == 1.0
        assert jobs.running == 2
        assert jobs.waited_past(0.5, 4.0) == [1, 3]
        assert jobs.waited_past(2.5, 4.0) == [1]
        assert jobs.waited_past(3.5, 4.0) == []
        given = jobs.give_back(None)
        assert [e.id for e in given] == [1, 3]
        assert sorted(e.id for e in jobs) == [2, 4] and jobs.oldest_wait() is None

    scenario(body)


def test_a_cancellation_is_taken_once_and_only_by_a_task_that_began() -> None:
    async def body(jobs: RunningJobs) -> None:
        entry = jobs.claimed(job(1), ClaimTimes(0.0), idle)
        assert jobs.cancelled(1) is None, "its task has not begun: it could not clean up"
        jobs.began(entry)
        assert jobs.cancelled(1) is entry and entry.cancel.is_set()
        assert jobs.cancelled(1) is None
        assert jobs.cancelled(2) is None

    scenario(body)


def test_progress_is_taken_once_per_report() -> None:
    async def body(jobs: RunningJobs) -> None:
        entry = jobs.claimed(job(1, attempt=2), ClaimTimes(0.0), idle)
        assert jobs.take_progress() == {}
        entry.report_progress('{"n": 1}')
        entry.report_progress('{"n": 2}')
        assert jobs.take_progress() == {1: (2, '{"n": 2}')}
        assert jobs.take_progress() == {}
        entry.report_progress('{"n": 2}')  # the same value, reported again
        assert entry.take_progress() == '{"n": 2}'
        assert jobs.take_progress() == {}

    scenario(body)


def test_a_snapshot_does_not_change_with_the_registry() -> None:
    async def body(jobs: RunningJobs) -> None:
        entry = jobs.claimed(job(1), ClaimTimes(0.0), idle)
        snapshot = jobs.snapshot()
        jobs.finished(entry)
        assert list(snapshot) == [1] and not jobs
        entry.task.cancel()

    scenario(body)
