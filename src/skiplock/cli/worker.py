"""``skiplock worker``: run an App's jobs, in this process or in ``--processes`` of them."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from typing import Any

from skiplock import pooler
from skiplock.app import App
from skiplock.cli.databases import app_from_args
from skiplock.command_line import (
    CONCURRENCY,
    PORT,
    PROCESSES,
    RETENTION_DAYS,
    TCP_USER_TIMEOUT,
    prefetch_setting,
    seconds,
)
from skiplock.config import DATABASE_URL_ENV
from skiplock.errors import ConfigurationError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="run jobs",
        description="Run the jobs of an App's tasks until SIGTERM or Ctrl-C (running jobs "
        "then finish, up to --shutdown-timeout).",
    )
    p.add_argument("app", help="the App to run, as MODULE:ATTRIBUTE (e.g. myapp.tasks:app)")
    p.add_argument(
        "--queues",
        default=None,
        metavar="Q1,Q2",
        help="comma-separated queues to claim from (default: every queue a registered task "
        "names, or 'default' when there are none)",
    )
    p.add_argument(
        "--concurrency",
        type=CONCURRENCY,
        default=10,
        metavar="N",
        help="jobs run at once per process (default: %(default)s)",
    )
    p.add_argument(
        "--processes",
        type=PROCESSES,
        default=1,
        metavar="N",
        help="worker processes to run, restarted when they die; more than one helps "
        "CPU-bound sync handlers (default: %(default)s)",
    )
    p.add_argument(
        "--prefetch",
        type=prefetch_setting,
        default=None,
        metavar="auto|N",
        help="jobs to claim beyond free slots, so a start skips a claim round trip (they "
        "wait leased; given back at shutdown). auto sizes it from how long jobs and claims "
        "take: short jobs are claimed in batches, long ones not ahead (default: auto)",
    )
    p.add_argument(
        "--lease",
        type=seconds(above_zero=True),
        default=30.0,
        metavar="SECONDS",
        help="how long a claimed job is held without a heartbeat before another worker may "
        "rescue it; heartbeats extend it while the job runs (default: %(default)g)",
    )
    p.add_argument(
        "--poll-interval",
        type=seconds(above_zero=True),
        default=None,
        metavar="SECONDS",
        help="how often to look for jobs when no notification arrives; notifications wake "
        "the worker at once (default: 1, or 0.2 without a listener)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=seconds(),
        default=30.0,
        metavar="SECONDS",
        help="at shutdown, how long running jobs may take to finish before they are "
        "released back to their queue (default: %(default)g)",
    )
    p.add_argument(
        "--metrics-port",
        type=PORT,
        metavar="PORT",
        help="serve Prometheus metrics on this port; needs the metrics extra (default: no metrics)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics port binds: 127.0.0.1 is this machine only, 0.0.0.0 every "
        "interface (default: %(default)s)",
    )
    p.add_argument(
        "--history-retention-days",
        type=RETENTION_DAYS,
        default=7.0,
        metavar="DAYS",
        help="drop finished jobs older than this; 0 keeps them forever (default: %(default)g)",
    )
    p.add_argument(
        "--no-liveness-lock",
        action="store_true",
        help="behind a transaction-mode pooler (PgBouncer): rescue by lease expiry only "
        "(default: hold a liveness lock, so a dead worker's jobs are rescued at once)",
    )
    p.add_argument(
        "--tcp-user-timeout",
        type=TCP_USER_TIMEOUT,
        default=30.0,
        metavar="SECONDS",
        help="drop a connection whose peer stopped answering (a cut link) after about "
        "this long, by TCP keepalives and tcp_user_timeout, unless the URL sets them "
        "(0: the system's defaults; default 30)",
    )
    pooler.add_worker_arguments(p)  # --pooler, --listen-url, --no-listen
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.processes > 1:
        return _supervise(args)
    from skiplock.worker import Worker  # noqa: PLC0415

    app = app_from_args(args)
    if app.queue_databases and args.metrics_port:
        raise ConfigurationError(
            "--metrics-port does not serve an App with queue_databases yet: leave it out"
        )
    queues, unserved = worker_queues(args.queues, app)
    log = logging.getLogger("skiplock.cli")
    if args.queues is None:
        log.info("serving the queues of the registered tasks: %s", ", ".join(queues))
    for queue, tasks in unserved.items():
        log.info(
            "not serving queue %r (tasks %s): --queues leaves it out, so its jobs wait "
            "for another worker",
            queue,
            ", ".join(tasks),
        )
    metrics = None
    if args.metrics_port:
        try:
            from skiplock.metrics import PrometheusMetrics  # noqa: PLC0415

            metrics = PrometheusMetrics(app.database_url, app.schema)
        except ImportError:
            raise ConfigurationError(
                "--metrics-port needs prometheus_client: pip install 'skiplock[metrics]'"
            ) from None
        metrics.serve(args.metrics_port, args.metrics_host)
    worker_class: Any = Worker
    if app.queue_databases:  # queues over several databases: a Worker per database
        from skiplock.worker.routed import RoutedWorker  # noqa: PLC0415

        worker_class = RoutedWorker
    worker = worker_class(
        app,
        queues=queues,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        poll_interval=args.poll_interval,
        lease_seconds=args.lease,
        shutdown_timeout=args.shutdown_timeout,
        liveness_lock=not args.no_liveness_lock,
        tcp_user_timeout=args.tcp_user_timeout or None,
        **pooler.worker_settings(args, dict(os.environ)),
        metrics=metrics,
        history_retention=(
            None
            if args.history_retention_days <= 0
            else timedelta(days=args.history_retention_days)
        ),
    )
    worker.run()
    if worker.abandoned_threads:
        # Python joins worker threads at exit, and a stuck sync handler would keep this
        # process (and, in transactional mode, its transaction) alive after its job was
        # released to others. Everything is written and logged: leave now.
        logging.getLogger("skiplock.worker").warning(
            "exiting with %d sync handlers still running (abandoned at shutdown)",
            worker.abandoned_threads,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def worker_queues(option: str | None, app: App) -> tuple[list[str], dict[str, list[str]]]:
    """The queues a worker serves, and the registered tasks' queues it leaves out (with
    their tasks). Without ``--queues``: every queue a registered task names, so that no
    task's jobs wait unserved by default; "default" for an app with no tasks. Pure."""
    by_queue: dict[str, list[str]] = {}
    for name, task in sorted(app.tasks.items()):
        by_queue.setdefault(task.options.queue, []).append(name)
    if option is None:
        return sorted(by_queue) or ["default"], {}
    queues = [q.strip() for q in option.split(",") if q.strip()]
    return queues, {q: tasks for q, tasks in sorted(by_queue.items()) if q not in queues}


def _supervise(args: argparse.Namespace) -> int:
    """Run ``--processes`` single-process workers (worker/processes.py), each with this
    command's options, so CPU-bound sync handlers use every core."""
    command = [sys.executable, "-m", "skiplock", *["-v"] * args.verbose]
    if args.schema:
        command += ["--schema", args.schema]
    # The URL reaches the children through their environment, never their command line
    # (readable by every user of the machine): it may hold a password.
    env = dict(os.environ)
    if args.database_url:
        env[DATABASE_URL_ENV] = args.database_url
        command += ["--database-url-env", DATABASE_URL_ENV]
    command += [
        "worker",
        args.app,
        *(["--queues", args.queues] if args.queues is not None else []),
        "--concurrency",
        str(args.concurrency),
        "--lease",
        str(args.lease),
        "--shutdown-timeout",
        str(args.shutdown_timeout),
        "--prefetch",
        "auto" if args.prefetch is None else str(args.prefetch),
    ]
    if args.no_liveness_lock:
        command.append("--no-liveness-lock")
    command += pooler.child_arguments(args, env)
    command += ["--history-retention-days", _exactly(args.history_retention_days)]
    command += ["--tcp-user-timeout", _exactly(args.tcp_user_timeout)]
    if args.metrics_port:
        raise ConfigurationError(
            "--metrics-port serves one process; with --processes run the workers "
            "separately, each with its own port"
        )
    from skiplock.worker.processes import run_processes  # noqa: PLC0415

    return run_processes(command, args.processes, env=env)


def _exactly(value: float) -> str:
    """``value`` as the shortest text that reads back as the same float ("30", "0.1",
    "12.3456789"): a child of --processes gets the option as given. Pure."""
    text = repr(value)
    return text.removesuffix(".0")
