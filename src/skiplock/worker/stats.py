"""What a worker has done since it started, for tests and the curious."""

from __future__ import annotations

from dataclasses import dataclass


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
