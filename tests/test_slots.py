"""``concurrency`` caps the handlers running in the whole process, however many queues it
serves and whatever their mode: each producer reserves its slots before it claims, so
producers of different queues claiming at the same moment cannot all count the same free
slots (before, 3 slots over 4 queues ran 12 handlers at once).

Real workers, real PostgreSQL. Handlers record how many of them run at the same moment
(a shared counter under a lock, and its maximum); each waits, up to a bound, until the cap
has been reached once, so the test also shows the cap is used, not just respected.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import StartWorker, wait_until

QUEUES = ["q1", "q2", "q3", "q4"]
CONCURRENCY = 3
JOBS_PER_QUEUE = 8
# How long a handler waits for the cap to be reached once; only a broken worker (one that
# never runs CONCURRENCY handlers at once) waits it out, and the test then fails.
FILL_PATIENCE = 5.0


class Overlap:
    """How many handlers run at once, and the most that ever did."""

    def __init__(self, cap: int) -> None:
        self._lock = threading.Lock()
        self.cap = cap
        self.running = 0
        self.most = 0
        self.finished = 0
        self.filled = threading.Event()

    def enter(self) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
            if self.running >= self.cap:
                self.filled.set()

    def leave(self) -> None:
        with self._lock:
            self.running -= 1
            self.finished += 1

    def hold(self) -> float:
        """Seconds still to wait for the cap to be reached once (0 once it was)."""
        return 0.0 if self.filled.is_set() else FILL_PATIENCE


async def overlapping(overlap: Overlap) -> None:
    overlap.enter()
    try:
        deadline = time.monotonic() + overlap.hold()
        while not overlap.filled.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.01)  # overlap with the next ones too
    finally:
        overlap.leave()


def define_tasks(app: skiplock.App, overlap: Overlap, transactional: bool) -> list[Any]:
    tasks = []
    for queue in QUEUES:

        async def leased(n: int) -> None:
            await overlapping(overlap)

        tasks.append(app.task(name=f"leased.{queue}", queue=queue)(leased))
        if transactional:

            async def in_transaction(conn: psycopg.AsyncConnection[Any], n: int) -> None:
                await overlapping(overlap)

            tasks.append(
                app.task(name=f"transactional.{queue}", queue=queue, transactional=True)(
                    in_transaction
                )
            )
    return tasks


@pytest.mark.parametrize(
    ("transactional", "prefetch"),
    [(False, 0), (True, 0), (False, 2), (True, 2)],
    ids=["leased", "leased-and-transactional", "leased-prefetch", "both-prefetch"],
)
def test_concurrency_caps_the_whole_process_across_queues(
    app: skiplock.App, start_worker: StartWorker, transactional: bool, prefetch: int
) -> None:
    overlap = Overlap(CONCURRENCY)
    tasks = define_tasks(app, overlap, transactional)
    # Enqueued before the worker starts: every producer finds jobs on its first claim.
    with psycopg.connect(app.database_url) as conn:
        app.enqueue_many(conn, [t.job(n=n) for t in tasks for n in range(JOBS_PER_QUEUE)])
    total = len(tasks) * JOBS_PER_QUEUE

    start_worker(app, queues=QUEUES, concurrency=CONCURRENCY, prefetch=prefetch, poll_interval=0.05)
    wait_until(lambda: overlap.finished >= total, 60.0, "every job to run")

    assert overlap.most == CONCURRENCY, f"at most {overlap.most} handlers ran at once"
