"""Worker metrics for Prometheus (the ``metrics`` extra: ``pip install skiplock[metrics]``).

The worker reports through the small ``Metrics`` interface; ``NullMetrics`` costs nothing
when no ``--metrics-port`` is given, and prometheus_client is only imported when one is.
Queue depth and oldest ready age are read from the database at scrape time (cached for a
few seconds), so every worker can expose them without extra load per job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from skiplock import client


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


class PrometheusMetrics(NullMetrics):
    def __init__(self, database_url: str, schema: str, registry: Any = None) -> None:
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
        self.registry.register(_QueueCollector(database_url, schema))

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

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import start_http_server  # noqa: PLC0415

        start_http_server(port, addr=addr, registry=self.registry)


class _QueueCollector:
    """Per-queue figures from QUEUE_STATS, read at scrape time and cached briefly."""

    CACHE_SECONDS = 5.0

    def __init__(self, database_url: str, schema: str) -> None:
        self._url = database_url
        self._schema = schema
        self._lock = threading.Lock()
        self._cached: tuple[float, list[dict[str, Any]]] = (0.0, [])

    def _stats(self) -> list[dict[str, Any]]:
        with self._lock:
            at, rows = self._cached
            if time.monotonic() - at > self.CACHE_SECONDS:
                with psycopg.connect(self._url, autocommit=True, connect_timeout=5) as conn:
                    rows = client.queue_stats(conn, self._schema)
                self._cached = (time.monotonic(), rows)
            return rows

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
        try:
            rows = self._stats()
        except psycopg.Error:
            rows = []
        for row in rows:
            for state in ("available", "scheduled", "running", "retryable", "dead"):
                depth.add_metric([row["queue"], state], row[state])
            oldest.add_metric([row["queue"]], row["oldest_ready_seconds"] or 0.0)
        yield depth
        yield oldest
