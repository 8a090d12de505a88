"""``skiplock worker``: run an App's jobs, in this process or in ``--processes`` of them."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from skiplock.app import App
from skiplock.cli.databases import app_from_args
from skiplock.config import DATABASE_URL_ENV
from skiplock.errors import ConfigurationError
from skiplock.worker import Worker, command, processes
from skiplock.worker.command import RunsJobs
from skiplock.worker.options import WorkerOptions

if TYPE_CHECKING:
    from skiplock.metrics import PrometheusMetrics

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
    command.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.processes > 1:
        env = dict(os.environ)
        return processes.run_fleet(_worker_program(args, env), vars(args), env)
    app = app_from_args(args)
    if app.queue_databases and args.metrics_port:
        raise ConfigurationError(
            "--metrics-port does not serve an App with queue_databases yet: leave it out"
        )
    given = vars(args)
    worker_options = WorkerOptions.from_arguments(
        given, os.environ, queues=_queues_told(args.queues, app)
    )
    metrics = command.serve_metrics(given, app)
    command.run_to_the_end(_worker(app, worker_options, metrics))
    return 0


def _worker(app: App, options: WorkerOptions, metrics: PrometheusMetrics | None) -> RunsJobs:
    """A Worker; for an App with queue_databases, a RoutedWorker (a Worker per database)."""
    if not app.queue_databases:
        return Worker(app, options, metrics=metrics)
    from skiplock.worker.routed import RoutedWorker  # noqa: PLC0415

    return RoutedWorker(app, **{f.name: getattr(options, f.name) for f in fields(options)})


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
    queues = command.queue_names(option)
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
