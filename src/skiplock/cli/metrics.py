"""``skiplock metrics``: the database's figures for Prometheus, from one process of its own.

Queue depth per state, oldest ready age, jobs enqueued (the jobs' id sequence) and the
workers registered describe the whole database: exported by every worker they would be
counted once per worker. Workers export them only while they lead (metrics.py); this
command exports them and nothing else, for a deployment that scrapes one stable target for
them (then give the workers ``queue_gauges="never"`` if they export too, or query with
``max by (queue, state)``: docs/metrics.md). It reads the database at most once per
``--refresh`` seconds, however often it is scraped.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from skiplock.app import App
from skiplock.command_line import PORT, seconds
from skiplock.errors import ConfigurationError

DEFAULT_PORT = 9808


def add_parser(sub: Any) -> None:
    """Register the command on the CLI's subparsers."""
    p = sub.add_parser(
        "metrics",
        help="serve the queue gauges for Prometheus from a process of their own",
        description=(
            "Serves /metrics with the per-queue job counts, oldest ready age, jobs enqueued "
            "and workers registered, read from the database at most once per --refresh "
            "seconds. Runs until SIGTERM or Ctrl-C. Needs the metrics extra."
        ),
    )
    p.add_argument(
        "--port", type=PORT, default=DEFAULT_PORT, help="port to serve (default %(default)s)"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default %(default)s: this machine only; the figures name "
        "queues and tasks)",
    )
    p.add_argument(
        "--refresh",
        type=seconds(),
        default=15.0,
        metavar="SECONDS",
        help="read the database at most this often (default %(default)s)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.refresh < 0:
        raise ConfigurationError(f"--refresh must be >= 0 seconds, got {args.refresh}")
    if not 0 < args.port < 65536:
        raise ConfigurationError(f"--port must be from 1 to 65535, got {args.port}")
    app = App(args.database_url, schema=args.schema)
    app.check_schema()  # a missing migration is named now, not as empty gauges later
    registry = exporter_registry(app.database_url, app.schema, args.refresh)
    from prometheus_client import start_http_server  # noqa: PLC0415

    try:
        start_http_server(args.port, addr=args.host, registry=registry)
    except OSError as exc:  # the port is taken, the address is not this machine's, ...
        raise ConfigurationError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    print(f"skiplock metrics: serving http://{args.host}:{args.port}/metrics", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    return 0


def exporter_registry(database_url: str, schema: str, refresh_seconds: float) -> Any:
    """A registry holding the database's figures only (what the command serves)."""
    try:
        from prometheus_client import CollectorRegistry  # noqa: PLC0415
    except ImportError:
        raise ConfigurationError(
            "skiplock metrics needs prometheus_client: pip install 'skiplock[metrics]'"
        ) from None
    from skiplock.metrics import QueueCollector  # noqa: PLC0415

    registry = CollectorRegistry()
    registry.register(QueueCollector(database_url, schema, refresh_seconds))
    return registry
