"""Prometheus metrics: a real worker reports outcomes, claims and completer batches into
its own registry; queue depth is read from the database when scraped.

The registry is read only after the worker has stopped (its final flush is reported by
then) and that first read is the queue gauges' first scrape, so their few seconds of
caching never serve figures from before the run ended.
"""

from __future__ import annotations

from typing import Any

import skiplock
from conftest import wait_until
from skiplock.metrics import NullMetrics, PrometheusMetrics
from skiplock.retry import RetryPolicy
from skiplock.sql import metrics as metrics_sql
from skiplock.sql import render

from .conftest import Ops, StartWorker

# A millisecond's back-off: the retry goes through 'retryable' and the promoter, which
# announces it (with none at all it waits for a full claim sweep: an xfail in test_worker.py).
QUICK_RETRY = RetryPolicy(base=0.001, cap=0.001, jitter=0.0)
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=2"


def sample(metrics: PrometheusMetrics, name: str, **labels: str) -> float | None:
    value = metrics.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


def test_null_metrics_is_the_default_and_does_nothing(ops: Ops) -> None:
    worker = skiplock.Worker(ops.app)

    assert type(worker.metrics) is NullMetrics
    null = NullMetrics()  # every call is accepted and has no effect
    null.job_finished("q", "t", "completed", 0.1)
    null.claimed("q", 3)
    null.flushed(3, 0)
    null.rescued(1)


def test_each_instance_has_its_own_registry(ops: Ops) -> None:
    first = PrometheusMetrics(ops.url, ops.schema)
    second = PrometheusMetrics(ops.url, ops.schema)  # no "duplicated timeseries"
    first.claimed("default", 2)

    assert first.registry is not second.registry
    assert sample(first, "skiplock_claimed_jobs_total", queue="default") == 2
    assert sample(second, "skiplock_claimed_jobs_total", queue="default") is None


def test_a_worker_run_shows_in_the_registry(ops: Ops, run_worker: StartWorker) -> None:
    app = ops.app

    @app.task(name="ok")
    def ok() -> None:
        return None

    @app.task(name="flaky", max_attempts=2, retry=QUICK_RETRY)
    def flaky() -> None:
        if skiplock.current_job().attempts == 1:
            raise ValueError("first attempt fails")

    @app.task(name="doomed", max_attempts=1)
    def doomed() -> None:
        raise ValueError("always fails")

    with ops.connect(autocommit=False) as conn:
        for _ in range(3):
            ok.enqueue(conn)
        flaky.enqueue(conn)
        doomed.enqueue(conn)
        conn.commit()
    ops.job(queue="unserved", run_at=-5)
    metrics = PrometheusMetrics(ops.url, ops.schema)

    worker = run_worker(app, metrics=metrics)
    wait_until(
        lambda: (
            ops.count("history", "state = 'completed'") == 4
            and ops.count("jobs", "state = 'dead'") == 1
        ),
        what="every job to finish",
    )
    worker.stop()

    def jobs(task: str, outcome: str) -> float | None:
        return sample(metrics, "skiplock_jobs_total", queue="default", task=task, outcome=outcome)

    assert jobs("ok", "completed") == 3
    assert jobs("flaky", "retried") == 1
    assert jobs("flaky", "completed") == 1
    assert jobs("doomed", "dead") == 1
    assert jobs("ok", "dead") is None
    assert sample(metrics, "skiplock_claimed_jobs_total", queue="default") == 6  # attempts
    assert sample(metrics, "skiplock_claimed_jobs_total", queue="unserved") is None
    assert sample(metrics, "skiplock_job_duration_seconds_count", queue="default", task="ok") == 3
    # Every outcome was written in some batch; none was refused, nothing needed rescue.
    assert sample(metrics, "skiplock_completer_batch_size_sum") == 6
    batches = sample(metrics, "skiplock_completer_batch_size_count")
    assert batches is not None
    assert 1 <= batches <= 6
    assert sample(metrics, "skiplock_refused_stale_writes_total") == 0
    assert sample(metrics, "skiplock_rescued_jobs_total") == 0
    # Queue gauges, from the database at scrape time.
    assert sample(metrics, "skiplock_queue_jobs", queue="default", state="dead") == 1
    assert sample(metrics, "skiplock_queue_jobs", queue="default", state="available") == 0
    assert sample(metrics, "skiplock_queue_jobs", queue="unserved", state="available") == 1
    oldest = sample(metrics, "skiplock_queue_oldest_ready_seconds", queue="unserved")
    assert oldest is not None
    assert oldest >= 5
    assert sample(metrics, "skiplock_queue_oldest_ready_seconds", queue="default") == 0


def test_rescues_are_counted(ops: Ops, run_worker: StartWorker) -> None:
    """The leader gives back a job whose lease ran out on a worker long gone."""
    app = ops.app

    @app.task(name="orphan")
    def orphan() -> None:
        return None

    job_id = ops.job(task="orphan", state="running", lease_expires_at=-1)
    metrics = PrometheusMetrics(ops.url, ops.schema)

    worker = run_worker(app, metrics=metrics)
    wait_until(lambda: ops.state_of(job_id) == "completed", what="the rescued job to run")
    worker.stop()

    assert sample(metrics, "skiplock_rescued_jobs_total") == 1
    assert (
        sample(metrics, "skiplock_jobs_total", queue="default", task="orphan", outcome="completed")
        == 1
    )


def test_transactional_jobs_are_counted(ops: Ops, run_worker: StartWorker) -> None:
    app = ops.app

    @app.task(name="in_transaction", transactional=True)
    def in_transaction(conn: Any) -> None:
        return None

    with ops.connect(autocommit=False) as conn:
        job_id = int(in_transaction.enqueue(conn))
        conn.commit()
    metrics = PrometheusMetrics(ops.url, ops.schema)

    worker = run_worker(app, metrics=metrics)
    wait_until(lambda: ops.state_of(job_id) == "completed", what="the job to complete")
    worker.stop()

    assert sample(metrics, "skiplock_claimed_jobs_total", queue="default") == 1
    assert (
        sample(
            metrics,
            "skiplock_jobs_total",
            queue="default",
            task="in_transaction",
            outcome="completed",
        )
        == 1
    )


def test_an_unreachable_database_leaves_the_gauges_out(ops: Ops) -> None:
    metrics = PrometheusMetrics(UNREACHABLE, ops.schema)
    metrics.rescued(2)

    # The scrape still answers; only the figures read from the database are missing.
    assert sample(metrics, "skiplock_rescued_jobs_total") == 2
    assert sample(metrics, "skiplock_queue_jobs", queue="default", state="available") is None


def test_scrapes_between_refreshes_are_served_the_figures_read_last(ops: Ops) -> None:
    """However often Prometheus scrapes, the database is read once per refresh period."""
    ops.job(queue="emails")
    metrics = PrometheusMetrics(ops.url, ops.schema, refresh_seconds=3600)

    assert sample(metrics, "skiplock_queue_jobs", queue="emails", state="available") == 1
    ops.job(queue="emails")
    for _ in range(5):
        assert sample(metrics, "skiplock_queue_jobs", queue="emails", state="available") == 1
    assert metrics.queues.refreshes == 1

    every_scrape = PrometheusMetrics(ops.url, ops.schema, refresh_seconds=0)
    assert sample(every_scrape, "skiplock_queue_jobs", queue="emails", state="available") == 2
    assert sample(every_scrape, "skiplock_queue_jobs", queue="emails", state="blocked") == 0
    assert every_scrape.queues.refreshes == 2  # one per scrape


def scanned_relations(plan: dict[str, Any]) -> list[str]:
    """Every table a plan reads, once per scan node."""
    found = [plan["Relation Name"]] if "Relation Name" in plan else []
    for child in plan.get("Plans", []):
        found += scanned_relations(child)
    return found


def test_the_gauges_read_the_jobs_table_once_and_nothing_else(ops: Ops) -> None:
    """QUEUE_STATS (`skiplock status`) also reads history, workers and every error record;
    a scrape needs none of it (the costs measured: sql/metrics.py)."""
    with ops.connect() as conn:
        row = conn.execute(
            "EXPLAIN (FORMAT JSON) " + render(metrics_sql.QUEUE_GAUGES, ops.schema)
        ).fetchone()
    assert row is not None

    assert scanned_relations(row[0][0]["Plan"]) == ["jobs"]
