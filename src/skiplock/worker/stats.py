"""What a worker has done since it started, for tests and the curious."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from skiplock.events import NoEvents
from skiplock.types import ClaimedJob


@dataclass
class WorkerStats:
    claimed: int = 0
    # Lease-mode claims that brought jobs, and the most jobs one of them brought: with
    # claim-ahead, short jobs come in batches larger than the worker's concurrency.
    claims: int = 0
    largest_claim: int = 0
    lost_leases: int = 0
    rescued: int = 0
    transactional_completed: int = 0
    admitted: int = 0


class StatsEvents(NoEvents):
    """Counts the job events into ``stats``."""

    def __init__(self, stats: WorkerStats) -> None:
        self.stats = stats

    def claimed(self, queue: str, count: int, jobs: Sequence[ClaimedJob]) -> None:
        stats = self.stats
        stats.claimed += count
        if jobs:  # a lease-mode claim
            stats.claims += 1
            stats.largest_claim = max(stats.largest_claim, len(jobs))

    def lost(self, job: ClaimedJob, attempt: int) -> None:
        self.stats.lost_leases += 1
