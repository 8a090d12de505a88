"""``manage.py skiplock_worker``: ``skiplock worker`` with Django set up, for the tasks of a
SkiplockBackend. The options are those of ``skiplock worker`` (a test keeps them so),
less the App argument: the backend (``--backend``, default "default") says where the jobs
are, and its QUEUES are the default ``--queues``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from skiplock import pooler
from skiplock.errors import ConfigurationError, SkiplockError

log = logging.getLogger("skiplock.contrib.django")


def prefetch_setting(text: str) -> int | None:
    """``--prefetch``: 'auto' (None: sized from job durations) or a count >= 0."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 0, got {text!r}")
    return value


class Command(BaseCommand):
    help = "Run a skiplock worker for the tasks of a SkiplockBackend."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--backend", default="default", help="the TASKS alias to run (default: default)"
        )
        parser.add_argument(
            "--queues", default=None, help="comma-separated (default: the backend's QUEUES)"
        )
        parser.add_argument("--concurrency", type=int, default=10, help="jobs at once")
        parser.add_argument("--processes", type=int, default=1, help="worker processes to run")
        parser.add_argument(
            "--prefetch",
            type=prefetch_setting,
            default=None,
            metavar="auto|N",
            help="jobs to claim beyond free slots (default auto; 0 turns it off)",
        )
        parser.add_argument("--lease", type=float, default=30.0, help="lease seconds")
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=None,
            help="fallback poll seconds (default 1; 0.2 without a listener)",
        )
        parser.add_argument("--shutdown-timeout", type=float, default=30.0)
        parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics here")
        parser.add_argument("--metrics-host", default="127.0.0.1")
        parser.add_argument(
            "--history-retention-days",
            type=float,
            default=7.0,
            help="drop finished jobs older than this (0 keeps them forever)",
        )
        parser.add_argument(
            "--no-liveness-lock",
            action="store_true",
            help="behind a transaction-mode pooler (PgBouncer): rescue by lease expiry only",
        )
        parser.add_argument(
            "--tcp-user-timeout",
            type=float,
            default=30.0,
            help="drop a connection whose peer stopped answering after about this long "
            "(TCP keepalives and tcp_user_timeout, unless the URL sets them; 0: the "
            "system's defaults; default 30)",
        )
        pooler.add_worker_arguments(parser)  # --pooler, --listen-url, --no-listen

    def handle(self, *args: Any, **options: Any) -> None:
        _configure_logging(int(options["verbosity"]))
        try:
            if options["processes"] > 1:
                _supervise(options["processes"])
                return
            _run(options)
        except SkiplockError as exc:
            raise CommandError(str(exc)) from exc


def _configure_logging(verbosity: int) -> None:
    """As ``skiplock`` does, unless Django's LOGGING already routes the root logger."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if verbosity > 2 else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    logging.getLogger("skiplock").setLevel(logging.DEBUG if verbosity > 2 else logging.INFO)
    # Failed and dead jobs are always shown; -v 2 adds each job's claim and completion.
    logging.getLogger("skiplock.jobs").setLevel(logging.INFO if verbosity > 1 else logging.WARNING)


def _run(options: dict[str, Any]) -> None:
    from skiplock.contrib.django.backend import SkiplockBackend  # noqa: PLC0415
    from skiplock.contrib.django.compat import task_backends  # noqa: PLC0415
    from skiplock.contrib.django.worker import DjangoTasksApp  # noqa: PLC0415
    from skiplock.migrate import pending_migrations  # noqa: PLC0415
    from skiplock.worker import Worker  # noqa: PLC0415

    alias = options["backend"]
    try:
        backend = task_backends[alias]
    except Exception as exc:
        raise CommandError(f"--backend {alias!r}: {exc}") from exc
    if not isinstance(backend, SkiplockBackend):
        raise CommandError(
            f"TASKS[{alias!r}] is {type(backend).__name__}, not "
            "skiplock.contrib.django.SkiplockBackend"
        )
    connection = backend.connection()
    connection.ensure_connection()
    pending = pending_migrations(connection.connection, backend.schema)
    connection.close()  # the worker opens its own; tasks open theirs per thread
    if pending:
        raise CommandError(
            f"skiplock's schema {backend.schema!r} in database {backend.database!r} is "
            f"missing migrations ({', '.join(m.label for m in pending)}); "
            "run `python manage.py migrate` first"
        )
    if options["queues"]:
        queues = [q.strip() for q in options["queues"].split(",") if q.strip()]
    else:
        queues = sorted(backend.queues) or ["default"]
    app = DjangoTasksApp(backend)
    metrics = None
    if options["metrics_port"]:
        try:
            from skiplock.metrics import PrometheusMetrics  # noqa: PLC0415

            metrics = PrometheusMetrics(app.database_url, app.schema)
        except ImportError:
            raise ConfigurationError(
                "--metrics-port needs prometheus_client: pip install 'skiplock[metrics]'"
            ) from None
        metrics.serve(options["metrics_port"], options["metrics_host"])
    retention = options["history_retention_days"]
    worker = Worker(
        app,
        queues=queues,
        concurrency=options["concurrency"],
        prefetch=options["prefetch"],
        poll_interval=options["poll_interval"],
        lease_seconds=options["lease"],
        shutdown_timeout=options["shutdown_timeout"],
        liveness_lock=not options["no_liveness_lock"],
        tcp_user_timeout=options["tcp_user_timeout"] or None,
        **pooler.worker_settings(argparse.Namespace(**options), dict(os.environ)),
        metrics=metrics,
        history_retention=None if retention <= 0 else timedelta(days=retention),
    )
    app.worker_id = str(worker.id)
    worker.run()
    if worker.abandoned_threads:
        # As `skiplock worker`: Python would wait for a stuck sync handler at exit.
        log.warning(
            "exiting with %d sync handlers still running (abandoned at shutdown)",
            worker.abandoned_threads,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _this_program() -> list[str]:
    """How this process was started: ``python manage.py`` (or django-admin), or ``python -m
    django``, which must be repeated as -m (run as a script, django/__main__.py would put
    the django package first on the path)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        return [sys.executable, "-m", spec.name.removesuffix(".__main__")]
    return [sys.executable, sys.argv[0]]


def _supervise(processes: int) -> None:
    """Run ``processes`` single-process workers (this command line with --processes 1),
    forwarding stop signals and restarting any that dies."""
    command = [*_this_program(), *sys.argv[1:], "--processes", "1"]
    # Each child in a session of its own: a Ctrl-C at the terminal then reaches them once,
    # forwarded from here (a second SIGINT tells a worker to give up on running jobs).
    children = [subprocess.Popen(command, start_new_session=True) for _ in range(processes)]
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        for i, child in enumerate(children):
            code = child.poll()
            if code is not None and not stopping:
                log.warning("worker process %s exited with %s; restarting it", child.pid, code)
                time.sleep(1)
                children[i] = subprocess.Popen(command, start_new_session=True)
        if stopping and all(c.poll() is not None for c in children):
            return
        time.sleep(0.2)
