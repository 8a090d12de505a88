"""Worker metrics for Prometheus (the ``metrics`` extra: ``pip install skiplock[metrics]``).

The worker reports through the small ``Metrics`` protocol: the job events reach it through
``MetricsEvents``, a subscriber to the worker's event stream (events.py), and the rest
(flushes, rescues, restarts, the worker's start and stop) by direct calls.
``NullMetrics`` costs nothing when no ``--metrics-port`` is given, and prometheus_client
is only imported when one is. Queue depth and oldest ready age are read from the database
by one statement (sql/metrics.py) at most once per ``refresh_seconds`` however often
Prometheus scrapes; scrapes in between are served the figures read last. The port binds
127.0.0.1 unless told otherwise: the figures name queues and tasks.

The figures read from the database describe the whole database, not one process: a worker
exports them only while it is the elected leader (``queue_gauges="leader"``), so that N
workers do not report every queue N times; ``skiplock metrics`` (cli/metrics.py)
exports them alone, from a process of its own. Every metric: docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import psycopg

from skiplock.events import NoEvents
from skiplock.outcomes import Outcome
from skiplock.sql import metrics as metrics_sql
from skiplock.sql import render
from skiplock.tracing import error_class
from skiplock.types import LIVE_STATES, WORKFLOW_STATES, ClaimedJob

# Where the figures read from the database come from (PrometheusMetrics' queue_gauges).
QUEUE_GAUGE_MODES = ("leader", "always", "never")


class Metrics(Protocol):
    """What the worker reports to its metrics."""

    def job_finished(self, queue: str, task: str, outcome: str, seconds: float) -> None: ...

    def claimed(self, queue: str, count: int) -> None: ...

    def flushed(self, batch: int, refused: int) -> None: ...

    def rescued(self, count: int) -> None: ...

    def service_restarted(self, service: str) -> None: ...

    def job_started(self, job: ClaimedJob, attempt: int, ran: float = 0.0) -> None: ...

    def job_failed(self, queue: str, task: str, error: Mapping[str, Any]) -> None: ...

    def worker_started(
        self, busy: Callable[[], int], slots: int, leads: Callable[[], bool]
    ) -> None: ...

    def worker_stopped(self) -> None: ...


class MetricsEvents(NoEvents):
    """The job events, counted into ``metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def claimed(self, queue: str, count: int, jobs: Sequence[ClaimedJob]) -> None:
        self.metrics.claimed(queue, count)

    def started(self, job: ClaimedJob, attempt: int, ago: float) -> None:
        self.metrics.job_started(job, attempt, ago)

    def ended(self, job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
        self.metrics.job_finished(job.queue, job.task, outcome.kind, seconds)
        if outcome.error is not None:
            self.metrics.job_failed(job.queue, job.task, outcome.error)


class NullMetrics:
    """The metrics of a worker that exports none: each report does nothing."""

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

    def job_started(self, job: ClaimedJob, attempt: int, ran: float = 0.0) -> None:
        """An attempt started (``ran`` seconds ago, when told after the fact)."""
        return None

    def job_failed(self, queue: str, task: str, error: Mapping[str, Any]) -> None:
        """An attempt failed (retried or dead); ``error`` is its stored error record."""
        return None

    def worker_started(
        self, busy: Callable[[], int], slots: int, leads: Callable[[], bool]
    ) -> None:
        """The worker runs: ``busy`` counts its slots running a job now and ``leads``
        says whether it is the elected leader; both are called from the scrape's thread."""
        return None

    def worker_stopped(self) -> None:
        return None


class PrometheusMetrics(NullMetrics):
    """The worker's figures in a registry of their own (``registry``), plus the database's
    (QueueCollector) as ``queue_gauges`` says: ``leader`` (while this process runs the
    elected leader, or runs no worker), ``always`` or ``never``."""

    def __init__(
        self,
        database_url: str,
        schema: str,
        registry: Any = None,
        *,
        refresh_seconds: float = 30.0,
        queue_gauges: str = "leader",
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: PLC0415

        if queue_gauges not in QUEUE_GAUGE_MODES:
            raise ValueError(
                f"queue_gauges={queue_gauges!r}: choose one of {', '.join(QUEUE_GAUGE_MODES)}"
            )
        self.registry = registry if registry is not None else CollectorRegistry()
        # Every metric in the one registry.
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self._jobs = counter(
            "skiplock_jobs",
            "Job attempts finished, by outcome (completed, retried, dead)",
            ["queue", "task", "outcome"],
        )
        self._duration = histogram(
            "skiplock_job_duration_seconds",
            "Handler run time",
            ["queue", "task"],
            buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, 600),
        )
        self._claimed = counter(
            "skiplock_claimed_jobs",
            "Jobs claimed by this worker",
            ["queue"],
        )
        self._batch = histogram(
            "skiplock_completer_batch_size",
            "Outcomes written per flush",
            buckets=(1, 5, 10, 50, 100, 500, 1000, 5000),
        )
        self._refused = counter(
            "skiplock_refused_stale_writes",
            "Outcomes refused because the lease was lost (the job was rescued)",
        )
        self._rescued = counter(
            "skiplock_rescued_jobs",
            "Jobs of dead workers or expired leases given back",
        )
        self._restarts = counter(
            "skiplock_service_restarts",
            "Restarts of a worker service after it raised (the traceback is in the log)",
            ["service"],
        )
        self._attempts = counter(
            "skiplock_attempts",
            "Attempts started, by queue and task (a retry is one more)",
            ["queue", "task"],
        )
        self._queue_wait = histogram(
            "skiplock_queue_wait_seconds",
            "From a job's due time (its run_at: enqueue, or the time it was scheduled for) "
            "to the start of its first attempt",
            ["queue"],
            buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, 600, 3600),
        )
        self._failures = counter(
            "skiplock_job_failures",
            "Failed attempts (retried or dead), by the exception class the handler raised",
            ["queue", "task", "error"],
        )
        self._up = gauge("skiplock_worker_up", "1 while this process runs a worker")
        self._slots = gauge("skiplock_worker_slots", "Jobs this worker may run at once")
        self._busy = gauge(
            "skiplock_worker_busy_slots",
            "Slots of this worker running a job at scrape time",
        )
        self._leader = gauge(
            "skiplock_worker_leader",
            "1 while this worker is the elected leader (it then exports the queue gauges)",
        )
        self._leads: Callable[[], bool] | None = None
        self._queue_gauges = queue_gauges
        self.queues = QueueCollector(database_url, schema, refresh_seconds)
        if queue_gauges != "never":
            self.registry.register(_Gated(self.queues, self._exports_queues))

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

    def job_started(self, job: ClaimedJob, attempt: int, ran: float = 0.0) -> None:
        self._attempts.labels(job.queue, job.task).inc()
        if attempt == 1:
            # Only first attempts: a retry's wait would count its back-off, chosen on
            # purpose, as time in line. Clocks of worker and database may differ a little.
            wait = time.time() - ran - job.run_at.timestamp()
            self._queue_wait.labels(job.queue).observe(max(wait, 0.0))

    def job_failed(self, queue: str, task: str, error: Mapping[str, Any]) -> None:
        self._failures.labels(queue, task, error_class(error)).inc()

    def worker_started(
        self, busy: Callable[[], int], slots: int, leads: Callable[[], bool]
    ) -> None:
        self._up.set(1)
        self._slots.set(slots)
        self._busy.set_function(busy)
        self._leader.set_function(lambda: 1 if leads() else 0)
        self._leads = leads

    def worker_stopped(self) -> None:
        self._leads = None
        self._up.set(0)
        self._busy.set_function(lambda: 0)
        self._leader.set_function(lambda: 0)

    def _exports_queues(self) -> bool:
        """With ``leader``: a process that runs no worker (yet, or any more) exports
        them too, so that a PrometheusMetrics of its own reads the database."""
        if self._queue_gauges == "always":
            return True
        leads = self._leads
        return leads is None or leads()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server  # noqa: PLC0415

        start_http_server(port, addr=addr, registry=self.registry)


# Every state a live job can be in, each reported for every queue seen (0 when none).
GAUGE_STATES = LIVE_STATES


class _Gated:
    """A collector that yields only while ``when()`` says so (the queue gauges of a
    worker that is not the leader), without reading anything otherwise."""

    def __init__(self, collector: QueueCollector, when: Callable[[], bool]) -> None:
        self._collector = collector
        self._when = when

    def collect(self) -> Iterator[Any]:
        if self._when():
            yield from self._collector.collect()

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: the names are fixed


class QueueCollector:
    """Per-queue figures from QUEUE_GAUGES, and the database-wide ones of
    ENQUEUED_AND_WORKERS, read at most once per ``refresh_seconds``."""

    def __init__(self, database_url: str, schema: str, refresh_seconds: float = 30.0) -> None:
        self._url = database_url
        self._sql = render(metrics_sql.QUEUE_GAUGES, schema)
        self._totals_sql = render(metrics_sql.ENQUEUED_AND_WORKERS, schema)
        self._workflows_sql = render(metrics_sql.WORKFLOW_GAUGES, schema)
        self._table = f'"{schema}".jobs'
        self._refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._rows: list[tuple[str, str, int, float | None]] = []
        # (ids drawn, workers registered, their slots), or None when the read failed.
        self._totals: tuple[int | None, int, int] | None = None
        # Workflows per state, or None when the read failed (a role without the table).
        self._workflows: dict[str, int] | None = None
        self.refreshes = 0  # statements run, for tests and curious operators

    def _current(self) -> list[tuple[str, str, int, float | None]]:
        """The figures, refreshed when older than the period. A failed read is retried at
        the next period too, not at every scrape, and leaves the gauges out meanwhile."""
        with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self._refresh_seconds:
                self._read_at = now
                self.refreshes += 1
                self._rows, self._totals, self._workflows = [], None, None
                try:
                    with psycopg.connect(
                        self._url,
                        autocommit=True,
                        connect_timeout=5,
                        options=metrics_sql.GAUGES_STATEMENT_TIMEOUT,
                    ) as conn:
                        self._rows = conn.execute(self._sql).fetchall()
                        # Apart: a role that may not read the sequence still gets the rest.
                        with contextlib.suppress(psycopg.Error):
                            row = conn.execute(self._totals_sql, {"table": self._table}).fetchone()
                            if row is not None:
                                self._totals = (row[0], int(row[1]), int(row[2]))
                        with contextlib.suppress(psycopg.Error):
                            rows = conn.execute(self._workflows_sql).fetchall()
                            self._workflows = {str(state): int(n) for state, n in rows}
                except psycopg.Error:
                    pass
            return self._rows

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

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
        totals = self._totals
        if totals is not None:
            drawn, workers, slots = totals
            yield CounterMetricFamily(
                "skiplock_enqueued_jobs",
                "Job ids handed out by the jobs table's sequence: every job enqueued, by "
                "any client, plus enqueues rolled back and unique duplicates (an upper bound)",
                value=drawn or 0,
            )
            yield GaugeMetricFamily(
                "skiplock_workers", "Worker processes registered (alive)", value=workers
            )
            yield GaugeMetricFamily(
                "skiplock_workers_slots", "Slots of the registered workers, summed", value=slots
            )
        workflows = self._workflows
        if workflows is not None:
            by_state = GaugeMetricFamily(
                "skiplock_workflows",
                "Workflows and batches per state (ended ones until pruned with history)",
                labels=["state"],
            )
            for state in WORKFLOW_STATES:
                by_state.add_metric([state], workflows.get(state, 0))
            yield by_state
