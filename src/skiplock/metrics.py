"""Worker metrics for Prometheus (the ``metrics`` extra: ``pip install skiplock[metrics]``).

The worker reports through the small ``Metrics`` interface; ``NullMetrics`` costs nothing
when no ``--metrics-port`` is given, and prometheus_client is only imported when one is.
Queue depth and oldest ready age are read from the database by one statement
(sql/metrics.py) at most once per ``refresh_seconds`` however often Prometheus scrapes;
scrapes in between are served the figures read last. The port binds 127.0.0.1 unless told
otherwise: the figures name queues and tasks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from skiplock.sql import metrics as metrics_sql
from skiplock.sql import render


class NullMetrics:
    """The interface, doing nothing."""

    def job_finished(self, queue: str, task: str, outcome: str, seconds: float) -> None:
        return None

    def claimed(self, queue: str, count: int) -> None:
        return None

    def flushed(self, batch: int, refused: int) -> None:
        return None

    def rescued(self, count: int) -> None:
        return None

    def service_restarted(self, service: str) -> None:
        return None


class PrometheusMetrics(NullMetrics):
    def __init__(
        self,
        database_url: str,
        schema: str,
        registry: Any = None,
        *,
        refresh_seconds: float = 30.0,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: PLC0415

        self.registry = registry if registry is not None else CollectorRegistry()
        self._jobs = Counter(
            "skiplock_jobs",
            "Job attempts finished, by outcome (completed, retried, dead)",
            ["queue", "task", "outcome"],
            registry=self.registry,
        )
        self._duration = Histogram(
            "skiplock_job_duration_seconds",
            "Handler run time",
            ["queue", "task"],
            registry=self.registry,
            buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, 600),
        )
        self._claimed = Counter(
            "skiplock_claimed_jobs",
            "Jobs claimed by this worker",
            ["queue"],
            registry=self.registry,
        )
        self._batch = Histogram(
            "skiplock_completer_batch_size",
            "Outcomes written per flush",
            registry=self.registry,
            buckets=(1, 5, 10, 50, 100, 500, 1000, 5000),
        )
        self._refused = Counter(
            "skiplock_refused_stale_writes",
            "Outcomes refused because the lease was lost (the job was rescued)",
            registry=self.registry,
        )
        self._rescued = Counter(
            "skiplock_rescued_jobs",
            "Jobs of dead workers or expired leases given back",
            registry=self.registry,
        )
        self._restarts = Counter(
            "skiplock_service_restarts",
            "Restarts of a worker service after it raised (the traceback is in the log)",
            ["service"],
            registry=self.registry,
        )
        self.queues = QueueCollector(database_url, schema, refresh_seconds)
        self.registry.register(self.queues)

    def job_finished(self, queue: str, task: str, outcome: str, seconds: float) -> None:
        self._jobs.labels(queue, task, outcome).inc()
        self._duration.labels(queue, task).observe(seconds)

    def claimed(self, queue: str, count: int) -> None:
        self._claimed.labels(queue).inc(count)

    def flushed(self, batch: int, refused: int) -> None:
        self._batch.observe(batch)
        if refused:
            self._refused.inc(refused)

    def rescued(self, count: int) -> None:
        self._rescued.inc(count)

    def service_restarted(self, service: str) -> None:
        self._restarts.labels(service).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server  # noqa: PLC0415

        start_http_server(port, addr=addr, registry=self.registry)


# Every state a live job can be in, each reported for every queue seen (0 when none).
GAUGE_STATES = ("blocked", "available", "scheduled", "running", "retryable", "dead")


class QueueCollector:
    """Per-queue figures from QUEUE_GAUGES, read at most once per ``refresh_seconds``."""

    def __init__(self, database_url: str, schema: str, refresh_seconds: float = 30.0) -> None:
        self._url = database_url
        self._sql = render(metrics_sql.QUEUE_GAUGES, schema)
        self._refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._rows: list[tuple[str, str, int, float | None]] = []
        self.refreshes = 0  # statements run, for tests and curious operators

    def _current(self) -> list[tuple[str, str, int, float | None]]:
        """The figures, refreshed when older than the period. A failed read is retried at
        the next period too, not at every scrape, and leaves the gauges out meanwhile."""
        with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self._refresh_seconds:
                self._read_at = now
                self.refreshes += 1
                try:
                    with psycopg.connect(
                        self._url,
                        autocommit=True,
                        connect_timeout=5,
                        options=metrics_sql.GAUGES_STATEMENT_TIMEOUT,
                    ) as conn:
                        self._rows = conn.execute(self._sql).fetchall()
                except psycopg.Error:
                    self._rows = []
            return self._rows

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

        depth = GaugeMetricFamily(
            "skiplock_queue_jobs", "Live jobs per queue and state", labels=["queue", "state"]
        )
        oldest = GaugeMetricFamily(
            "skiplock_queue_oldest_ready_seconds",
            "Age of the oldest ready job",
            labels=["queue"],
        )
        counts: dict[str, dict[str, int]] = {}
        ages: dict[str, float] = {}
        for queue, state, jobs, age in self._current():
            counts.setdefault(queue, dict.fromkeys(GAUGE_STATES, 0))[state] = jobs
            ages[queue] = max(ages.get(queue, 0.0), age or 0.0)
        for queue in sorted(counts):
            for state, jobs in counts[queue].items():
                depth.add_metric([queue, state], jobs)
            oldest.add_metric([queue], ages[queue])
        yield depth
        yield oldest
