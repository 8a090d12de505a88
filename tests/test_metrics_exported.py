"""Prometheus, complete (issue 13): attempts, queue wait, failures by exception class, the
worker's up, slots, busy and leader gauges; the database's figures (queue gauges with
the blocked state, jobs enqueued, workers registered) exported by the leader only, or by
`skiplock metrics`, a process of their own. Real database, real workers."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import SCHEMA, JobFactory, StartWorker, wait_until
from skiplock import cli
from skiplock.cli.metrics import exporter_registry
from skiplock.metrics import NullMetrics, PrometheusMetrics
from skiplock.retry import RetryPolicy
from skiplock.tracing import error_class

QUICK_RETRY = RetryPolicy(base=0.001, cap=0.001, jitter=0.0)
FAST: dict[str, Any] = {"poll_interval": 0.05, "rescue_interval": 0.05}


class CardDeclinedError(Exception):
    pass


def sample(registry: Any, name: str, **labels: str) -> float | None:
    value = registry.get_sample_value(name, labels)
    return None if value is None else float(value)


def metrics_for(app: skiplock.App, **options: Any) -> PrometheusMetrics:
    return PrometheusMetrics(app.database_url, app.schema, refresh_seconds=0, **options)


def test_the_new_calls_of_null_metrics_do_nothing() -> None:
    null = NullMetrics()
    job = skiplock.types.ClaimedJob(1, "q", "t", {}, 0, datetime.now(UTC), 1, 3, datetime.now(UTC))
    null.job_started(job, 1)
    null.job_failed("q", "t", {"type": "ValueError", "module": "builtins"})
    null.worker_started(lambda: 0, 4, lambda: False)
    null.worker_stopped()


def test_error_classes_are_qualified_unless_builtin() -> None:
    assert error_class({"type": "ValueError", "module": "builtins"}) == "ValueError"
    assert error_class({"type": "Declined", "module": "shop.payments"}) == "shop.payments.Declined"
    assert error_class({"type": "OutcomeNotStorableError"}) == "OutcomeNotStorableError"
    assert error_class({}) == "Exception"


def test_a_bad_queue_gauges_mode_is_refused_naming_the_choices(app: skiplock.App) -> None:
    with pytest.raises(ValueError, match="leader, always, never"):
        metrics_for(app, queue_gauges="sometimes")


def test_attempts_failures_and_queue_wait_of_a_worker_run(
    app: skiplock.App, start_worker: StartWorker, make_job: JobFactory
) -> None:
    @app.task(name="ok")
    def ok() -> None:
        return None

    @app.task(name="declined", max_attempts=2, retry=QUICK_RETRY)
    def declined() -> None:
        raise CardDeclinedError("no")

    @app.task(name="typo", max_attempts=1)
    def typo() -> None:
        raise KeyError("missing")

    # Due half a minute ago: it has waited at least that long when it starts.
    make_job(task="ok", run_at=datetime.now(UTC) - timedelta(seconds=30))
    with psycopg.connect(app.database_url) as conn:
        ok.enqueue(conn)
        declined.enqueue(conn)
        typo.enqueue(conn)
        conn.commit()
    metrics = metrics_for(app)
    worker = start_worker(app, metrics=metrics, **FAST)
    wait_until(
        lambda: sample(
            metrics.registry,
            "skiplock_jobs_total",
            queue="default",
            task="declined",
            outcome="dead",
        ),
        what="the declined job to die",
    )
    wait_until(
        lambda: sample(
            metrics.registry, "skiplock_jobs_total", queue="default", task="typo", outcome="dead"
        ),
        what="the typo job to die",
    )
    wait_until(
        lambda: (
            sample(
                metrics.registry,
                "skiplock_jobs_total",
                queue="default",
                task="ok",
                outcome="completed",
            )
            == 2
        ),
        what="both ok jobs",
    )
    worker.stop()
    registry = metrics.registry

    def attempts(task: str) -> float | None:
        return sample(registry, "skiplock_attempts_total", queue="default", task=task)

    assert (attempts("ok"), attempts("declined"), attempts("typo")) == (2, 2, 1)
    declined_class = f"{__name__}.CardDeclinedError"
    assert (
        sample(
            registry,
            "skiplock_job_failures_total",
            queue="default",
            task="declined",
            error=declined_class,
        )
        == 2
    )
    assert (
        sample(
            registry, "skiplock_job_failures_total", queue="default", task="typo", error="KeyError"
        )
        == 1
    )
    assert (
        sample(
            registry, "skiplock_job_failures_total", queue="default", task="ok", error="KeyError"
        )
        is None
    )
    # One wait per first attempt (the retry's back-off is not time in line).
    assert sample(registry, "skiplock_queue_wait_seconds_count", queue="default") == 4
    total_wait = sample(registry, "skiplock_queue_wait_seconds_sum", queue="default")
    assert total_wait is not None
    assert total_wait >= 30
    assert sample(registry, "skiplock_queue_wait_seconds_bucket", queue="default", le="5.0") == 3


def test_transactional_attempts_and_failures_are_counted(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    @app.task(name="tx_fails", transactional=True, max_attempts=1)
    def tx_fails(conn: Any) -> None:
        raise CardDeclinedError("declined in a transaction")

    with psycopg.connect(app.database_url) as conn:
        tx_fails.enqueue(conn)
        conn.commit()
    metrics = metrics_for(app)
    worker = start_worker(app, metrics=metrics, **FAST)
    wait_until(
        lambda: sample(
            metrics.registry,
            "skiplock_job_failures_total",
            queue="default",
            task="tx_fails",
            error=f"{__name__}.CardDeclinedError",
        ),
        what="the failure to be counted",
    )
    worker.stop()

    assert (
        sample(metrics.registry, "skiplock_attempts_total", queue="default", task="tx_fails") == 1
    )
    assert sample(metrics.registry, "skiplock_queue_wait_seconds_count", queue="default") == 1


def test_the_worker_gauges_follow_its_life(app: skiplock.App, start_worker: StartWorker) -> None:
    release = threading.Event()

    @app.task(name="held")
    def held() -> None:
        release.wait(30)

    metrics = metrics_for(app)
    registry = metrics.registry
    assert sample(registry, "skiplock_worker_up") == 0
    worker = start_worker(app, metrics=metrics, concurrency=3, **FAST)
    assert sample(registry, "skiplock_worker_up") == 1
    assert sample(registry, "skiplock_worker_slots") == 3
    assert sample(registry, "skiplock_worker_busy_slots") == 0
    wait_until(lambda: sample(registry, "skiplock_worker_leader") == 1, what="the election")
    with psycopg.connect(app.database_url) as conn:
        held.enqueue(conn)
        conn.commit()
    wait_until(lambda: sample(registry, "skiplock_worker_busy_slots") == 1, what="the job to run")
    release.set()
    wait_until(lambda: sample(registry, "skiplock_worker_busy_slots") == 0, what="the job to end")
    worker.stop()

    assert sample(registry, "skiplock_worker_up") == 0
    assert sample(registry, "skiplock_worker_leader") == 0


def test_queue_gauges_come_from_the_leader_only(
    app: skiplock.App, start_worker: StartWorker, make_job: JobFactory
) -> None:
    make_job(queue="emails")
    first, second = metrics_for(app), metrics_for(app)
    start_worker(app, metrics=first, queues=["other"], **FAST)
    start_worker(app, metrics=second, queues=["other"], **FAST)

    def leaders() -> list[float]:
        return [sample(m.registry, "skiplock_worker_leader") or 0.0 for m in (first, second)]

    wait_until(lambda: sorted(leaders()) == [0, 1], what="one of the two to be elected")
    leader, follower = (first, second) if leaders()[0] == 1 else (second, first)

    assert sample(leader.registry, "skiplock_queue_jobs", queue="emails", state="available") == 1
    assert (
        sample(follower.registry, "skiplock_queue_jobs", queue="emails", state="available") is None
    )
    assert sample(follower.registry, "skiplock_workers") is None
    assert follower.queues.refreshes == 0  # a follower's scrape reads nothing


def test_queue_gauges_always_or_never(
    app: skiplock.App, start_worker: StartWorker, make_job: JobFactory
) -> None:
    make_job(queue="emails")
    always, never = metrics_for(app, queue_gauges="always"), metrics_for(app, queue_gauges="never")
    leader = metrics_for(app)
    start_worker(app, metrics=leader, queues=["other"], **FAST)
    wait_until(lambda: sample(leader.registry, "skiplock_worker_leader") == 1, what="the election")
    start_worker(app, metrics=always, queues=["other"], **FAST)
    start_worker(app, metrics=never, queues=["other"], **FAST)

    assert sample(always.registry, "skiplock_queue_jobs", queue="emails", state="available") == 1
    assert sample(never.registry, "skiplock_queue_jobs", queue="emails", state="available") is None


def test_the_database_figures_count_blocked_jobs_enqueues_and_workers(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    keyed = app.task(name="keyed", queue="orders")(lambda n: None)
    with psycopg.connect(app.database_url) as conn:
        # No worker admits keyed jobs yet: they wait as blocked.
        app.enqueue_many(
            conn, [keyed.with_options(ordering_key="customer-7").job(n=n) for n in range(4)]
        )
        keyed.enqueue(conn, n=99)
        conn.commit()
    registry = exporter_registry(app.database_url, app.schema, 0)

    assert sample(registry, "skiplock_queue_jobs", queue="orders", state="blocked") == 4
    assert sample(registry, "skiplock_queue_jobs", queue="orders", state="available") == 1
    # Five jobs, and the id the bulk enqueue draws before its COPY (sql/enqueue.py).
    assert sample(registry, "skiplock_enqueued_jobs_total") == 6
    assert sample(registry, "skiplock_workers") == 0
    assert sample(registry, "skiplock_workers_slots") == 0

    start_worker(app, queues=["other"], concurrency=7, **FAST)
    assert sample(registry, "skiplock_workers") == 1
    assert sample(registry, "skiplock_workers_slots") == 7


def test_the_exporter_has_only_the_database_figures(app: skiplock.App) -> None:
    registry = exporter_registry(app.database_url, app.schema, 0)
    names = {metric.name for metric in registry.collect()}

    assert names == {
        "skiplock_queue_jobs",
        "skiplock_queue_oldest_ready_seconds",
        "skiplock_enqueued_jobs",
        "skiplock_workers",
        "skiplock_workers_slots",
        "skiplock_workflows",
    }


def test_workflows_are_counted_per_state_and_their_waiting_steps_as_waiting(
    app: skiplock.App,
) -> None:
    step = app.task(name="step", queue="flow")(lambda: None)
    with psycopg.connect(app.database_url) as conn:
        skiplock.chain(step.job(), step.job(), step.job(), app=app).enqueue(conn)
        cancelled = skiplock.chain(step.job(), step.job(), app=app).enqueue(conn)
        conn.commit()
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        skiplock.Admin(app, conn).cancel_jobs([int(ref) for ref in cancelled.steps.values()])
    registry = exporter_registry(app.database_url, app.schema, 0)

    assert sample(registry, "skiplock_workflows", state="running") == 1
    assert sample(registry, "skiplock_workflows", state="failed") == 1  # its steps cancelled
    assert sample(registry, "skiplock_workflows", state="completed") == 0
    assert sample(registry, "skiplock_queue_jobs", queue="flow", state="waiting") == 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_skiplock_metrics_serves_the_queue_gauges(app: skiplock.App, make_job: JobFactory) -> None:
    make_job(queue="reports")
    port = free_port()
    env = {**os.environ, "SKIPLOCK_DATABASE_URL": app.database_url}
    command = [sys.executable, "-m", "skiplock", "--schema", SCHEMA, "metrics", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        assert f"http://127.0.0.1:{port}/metrics" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        process.terminate()
        process.wait(timeout=10)

    assert process.returncode == 0
    assert 'skiplock_queue_jobs{queue="reports",state="available"} 1.0' in text
    assert "skiplock_enqueued_jobs_total 1.0" in text
    assert "skiplock_jobs_total" not in text  # a worker's figures are not the exporter's


def test_skiplock_metrics_refuses_bad_options_by_name(
    app: skiplock.App, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--database-url", app.database_url, "--schema", SCHEMA, "metrics"]

    assert cli.main([*base, "--refresh", "-1"]) == 2
    assert "--refresh must be >= 0" in capsys.readouterr().err
    assert cli.main([*base, "--port", "70000"]) == 2
    assert "--port must be from 1 to 65535" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main([*base, "--port", str(port)]) == 2
    assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err


DOCS = Path(__file__).resolve().parent.parent / "docs"


def exported_names(app: skiplock.App, start_worker: StartWorker) -> set[str]:
    """Every metric name a worker and the exporter serve, as scraped (with _total)."""
    metrics = metrics_for(app)
    start_worker(app, metrics=metrics, **FAST)
    wait_until(lambda: sample(metrics.registry, "skiplock_worker_leader") == 1, what="election")
    names: set[str] = set()
    for registry in (metrics.registry, exporter_registry(app.database_url, app.schema, 0)):
        for family in registry.collect():
            names.update(s.name for s in family.samples)
            if family.type == "histogram":  # labelled ones have no series until observed
                names.update(family.name + end for end in ("_bucket", "_count", "_sum"))
            else:
                names.add(family.name + ("_total" if family.type == "counter" else ""))
    return {name for name in names if not name.endswith("_created")}


def test_the_docs_and_the_dashboard_name_exactly_what_is_exported(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    exported = exported_names(app, start_worker)
    documented = set(
        re.findall(r"^\| `(skiplock_[a-z_]+)`", (DOCS / "metrics.md").read_text(), re.M)
    )
    dashboard = json.loads((DOCS / "grafana" / "skiplock.json").read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    used = {name for expr in expressions for name in re.findall(r"skiplock_[a-z_]+", expr)}

    # Histograms are documented by their base name; their series carry suffixes.
    def base(name: str) -> str:
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name.removesuffix(suffix) in documented:
                return name.removesuffix(suffix)
        return name

    assert {base(name) for name in exported} == documented
    assert used <= exported, used - exported
