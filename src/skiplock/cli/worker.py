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
    RETENTION_DAYS,
    TCP_USER_TIMEOUT,
    prefetch_setting,
    seconds,
)
from skiplock.config import DATABASE_URL_ENV
from skiplock.errors import ConfigurationError
from skiplock.worker import command, processes

log = logging.getLogger("skiplock.cli")


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
    command.add_arguments(p)  # --processes, --metrics-port, --metrics-host
    _add_worker_options(p)
    p.set_defaults(func=run)


def _add_worker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency",
        type=CONCURRENCY,
        default=10,
        metavar="N",
        help="jobs run at once per process (default: %(default)s)",
    )
    parser.add_argument(
        "--prefetch",
        type=prefetch_setting,
        default=None,
        metavar="auto|N",
        help="jobs to claim beyond free slots, so a start skips a claim round trip (they "
        "wait leased; given back at shutdown). auto sizes it from how long jobs and claims "
        "take: short jobs are claimed in batches, long ones not ahead (default: auto)",
    )
    parser.add_argument(
        "--lease",
        type=seconds(above_zero=True),
        default=30.0,
        metavar="SECONDS",
        help="how long a claimed job is held without a heartbeat before another worker may "
        "rescue it; heartbeats extend it while the job runs (default: %(default)g)",
    )
    parser.add_argument(
        "--poll-interval",
        type=seconds(above_zero=True),
        default=None,
        metavar="SECONDS",
        help="how often to look for jobs when no notification arrives; notifications wake "
        "the worker at once (default: 1, or 0.2 without a listener)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=seconds(),
        default=30.0,
        metavar="SECONDS",
        help="at shutdown, how long running jobs may take to finish before they are "
        "released back to their queue (default: %(default)g)",
    )
    parser.add_argument(
        "--history-retention-days",
        type=RETENTION_DAYS,
        default=7.0,
        metavar="DAYS",
        help="drop finished jobs older than this; 0 keeps them forever (default: %(default)g)",
    )
    parser.add_argument(
        "--no-liveness-lock",
        action="store_true",
        help="behind a transaction-mode pooler (PgBouncer): rescue by lease expiry only "
        "(default: hold a liveness lock, so a dead worker's jobs are rescued at once)",
    )
    parser.add_argument(
        "--tcp-user-timeout",
        type=TCP_USER_TIMEOUT,
        default=30.0,
        metavar="SECONDS",
        help="drop a connection whose peer stopped answering (a cut link) after about "
        "this long, by TCP keepalives and tcp_user_timeout, unless the URL sets them "
        "(0: the system's defaults; default 30)",
    )
    pooler.add_worker_arguments(parser)  # --pooler, --listen-url, --no-listen


def run(args: argparse.Namespace) -> int:
    if args.processes > 1:
        env = dict(os.environ)
        return processes.run_fleet(_worker_program(args, env), vars(args), env)
    from skiplock.worker import Worker  # noqa: PLC0415

    app = app_from_args(args)
    if app.queue_databases and args.metrics_port:
        raise ConfigurationError(
            "--metrics-port does not serve an App with queue_databases yet: leave it out"
        )
    queues = _queues_told(args.queues, app)
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
        metrics=command.serve_metrics(vars(args), app),
        history_retention=(
            None
            if args.history_retention_days <= 0
            else timedelta(days=args.history_retention_days)
        ),
    )
    command.run_to_the_end(worker)
    return 0


def _queues_told(option: str | None, app: App) -> list[str]:
    """``worker_queues``, with a log line for each queue of a registered task left out."""
    queues, unserved = worker_queues(option, app)
    if option is None:
        log.info("serving the queues of the registered tasks: %s", ", ".join(queues))
    for queue, tasks in unserved.items():
        log.info(
            "not serving queue %r (tasks %s): --queues leaves it out, so its jobs wait "
            "for another worker",
            queue,
            ", ".join(tasks),
        )
    return queues


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


def _worker_program(args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    """How one process of ``--processes`` starts: ``python -m skiplock`` with this
    command's global options and App. The URL goes into ``env``, the child's environment,
    never its command line: it may hold a password."""
    program = [sys.executable, "-m", "skiplock", *["-v"] * args.verbose]
    if args.schema:
        program += ["--schema", args.schema]
    if args.database_url:
        env[DATABASE_URL_ENV] = args.database_url
        program += ["--database-url-env", DATABASE_URL_ENV]
    program += ["worker", args.app]
    return program + ([] if args.queues is None else ["--queues", args.queues])
