"""What ``skiplock worker`` and ``manage.py skiplock_worker`` share: their flags (the
worker's options, how many processes to run, where Prometheus scrapes the worker), its
metrics, and how a worker process ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from skiplock.command_line import PORT, PROCESSES
from skiplock.errors import ConfigurationError
from skiplock.worker import options

if TYPE_CHECKING:
    from skiplock.app import App
    from skiplock.metrics import PrometheusMetrics

log = logging.getLogger("skiplock.worker")


class RunsJobs(Protocol):
    """A Worker, or a RoutedWorker over several databases."""

    @property
    def abandoned_threads(self) -> int: ...

    def run(self) -> None: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the worker's options (options.py), ``--processes``, ``--metrics-port`` and
    ``--metrics-host`` to ``parser``."""
    options.add_arguments(parser)
    parser.add_argument(
        "--processes",
        type=PROCESSES,
        default=1,
        metavar="N",
        help="worker processes to run, restarted when they die; more than one helps "
        "CPU-bound sync handlers (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=PORT,
        metavar="PORT",
        help="serve Prometheus metrics on this port; needs the metrics extra (default: no metrics)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics port binds: 127.0.0.1 is this machine only, 0.0.0.0 every "
        "interface (default: %(default)s)",
    )


def queue_names(text: str) -> list[str]:
    """The queues of a ``--queues`` value: comma-separated names, blanks dropped."""
    return [queue.strip() for queue in text.split(",") if queue.strip()]


def serve_metrics(given: Mapping[str, Any], app: App) -> PrometheusMetrics | None:
    """The worker's metrics, served on ``--metrics-port`` when given (else None)."""
    if not given.get("metrics_port"):
        return None
    try:
        from skiplock.metrics import PrometheusMetrics  # noqa: PLC0415

        metrics = PrometheusMetrics(app.database_url, app.schema)
    except ImportError:
        raise ConfigurationError(
            "--metrics-port needs prometheus_client: pip install 'skiplock[metrics]'"
        ) from None
    metrics.serve(given["metrics_port"], given["metrics_host"])
    return metrics


def run_to_the_end(worker: RunsJobs) -> None:
    """Run ``worker`` until it stops; then, if sync handlers are still running, leave the
    process at once. Python joins threads at exit, and a stuck handler would keep the
    process (in transactional mode, its transaction too) alive after its job went back
    to others; everything is written and logged by then."""
    worker.run()
    if not worker.abandoned_threads:
        return
    log.warning(
        "exiting with %d sync handlers still running (abandoned at shutdown)",
        worker.abandoned_threads,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
