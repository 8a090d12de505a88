"""The worker's job events (events.py): each transition of a job told once, on both
execution paths, to every subscriber, and the stats, metrics and log built on them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import StartWorker, wait_until
from skiplock.events import EventStream, NoEvents
from skiplock.metrics import MetricsEvents, NullMetrics
from skiplock.outcomes import Cancelled, Completed, Dead, Outcome, Retried, Snoozed
from skiplock.types import ClaimedJob
from skiplock.worker.job_log import JobLog
from skiplock.worker.stats import StatsEvents, WorkerStats

FAST = {"poll_interval": 0.05, "rescue_interval": 0.05}


class Recorder(NoEvents):
    """Every event, as (event, job id, detail)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, Any]] = []

    def claimed(self, queue: str, count: int, jobs: Sequence[ClaimedJob]) -> None:
        self.events.extend(("claimed", job.id, queue) for job in jobs)

    def started(self, job: ClaimedJob, attempt: int, ago: float) -> None:
        self.events.append(("started", job.id, attempt))

    def ended(self, job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
        self.events.append(("ended", job.id, type(outcome)))

    def of(self, job_id: int) -> list[tuple[str, Any]]:
        return [(event, detail) for event, jid, detail in self.events if jid == job_id]


def test_each_transition_is_told_once_on_both_paths(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    @app.task(name="fine")
    def fine() -> int:
        return 1

    @app.task(name="broken", max_attempts=1)
    def broken() -> None:
        raise ValueError("no")

    @app.task(name="later")
    async def later() -> None:
        raise skiplock.Snooze(after=3600)

    @app.task(name="tx", transactional=True, max_attempts=2)
    def tx(conn: psycopg.Connection[Any]) -> None:
        raise KeyError("again")

    recorder = Recorder()
    worker = start_worker(app, **FAST)
    assert worker.worker.parts is not None
    worker.worker.parts.events.subscribe(recorder)
    with psycopg.connect(app.database_url) as conn:
        ids = [int(fine.enqueue(conn)), int(broken.enqueue(conn)), int(later.enqueue(conn))]
        tx_id = int(tx.enqueue(conn))
        conn.commit()
    wait_until(
        lambda: sum(event == "ended" for event, _, _ in recorder.events) >= 4,
        what="every job to end",
    )
    worker.stop()
    fine_id, broken_id, later_id = ids
    assert recorder.of(fine_id) == [("claimed", "default"), ("started", 1), ("ended", Completed)]
    assert recorder.of(broken_id) == [("claimed", "default"), ("started", 1), ("ended", Dead)]
    assert recorder.of(later_id) == [("claimed", "default"), ("started", 1), ("ended", Snoozed)]
    # A transactional batch tells its jobs as they end: the start after the fact.
    assert recorder.of(tx_id)[:2] == [("started", 1), ("ended", Retried)]


class Counting(NullMetrics):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def claimed(self, queue: str, count: int) -> None:
        self.calls.append(("claimed", queue, count))

    def job_started(self, job: ClaimedJob, attempt: int, ran: float = 0.0) -> None:
        self.calls.append(("started", job.id, attempt, ran))

    def job_finished(self, queue: str, task: str, outcome: str, seconds: float) -> None:
        self.calls.append(("finished", task, outcome))

    def job_failed(self, queue: str, task: str, error: Any) -> None:
        self.calls.append(("failed", task, error["type"]))


def job(job_id: int = 7, attempts: int = 1) -> ClaimedJob:
    return ClaimedJob(job_id, "q", "t", {}, 0, None, attempts, 3, None)  # type: ignore[arg-type]


def test_the_stats_metrics_and_log_subscribers_read_the_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats, metrics = WorkerStats(), Counting()
    stream = EventStream(StatsEvents(stats), MetricsEvents(metrics), JobLog())
    claimed = [job(7), job(8)]
    with caplog.at_level(logging.INFO, logger="skiplock.jobs"):
        stream.claimed("q", 2, claimed)
        stream.claimed("q", 3)  # a transactional batch: its jobs are told as they end
        stream.started(claimed[0], 1)
        stream.ended(claimed[0], Completed(7, 1), 0.5)
        error = {"type": "ValueError", "message": "no", "traceback": None}
        stream.ended(claimed[1], Retried(8, 1, error, 2.0), 0.1)
        stream.ended(claimed[1], Cancelled(8, 1), 0.1)
        stream.lost(claimed[1], 1)
        stream.given_back(4)
    assert (stats.claimed, stats.claims, stats.largest_claim, stats.lost_leases) == (5, 1, 2, 1)
    assert metrics.calls == [
        ("claimed", "q", 2),
        ("claimed", "q", 3),
        ("started", 7, 1, 0.0),
        ("finished", "t", "completed"),
        ("finished", "t", "retried"),
        ("failed", "t", "ValueError"),
        ("finished", "t", "cancelled"),
    ]
    messages = [record.getMessage() for record in caplog.records]
    assert messages[:2] == [
        "job 7 (t) claimed from q, attempt 1/3",
        "job 8 (t) claimed from q, attempt 1/3",
    ]
    assert messages[2].startswith("job 7 (t) completed in 0.500s, attempt 1/3")
    assert messages[3] == "job 8 (t) failed, attempt 1/3: ValueError: no; retrying in 2s"
    assert messages[4].startswith("job 8 (t) cancelled in ")
