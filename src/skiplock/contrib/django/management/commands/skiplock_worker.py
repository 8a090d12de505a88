"""``manage.py skiplock_worker``: ``skiplock worker`` with Django set up, for the tasks of a
SkiplockBackend. The options are those of ``skiplock worker`` (both add them with
skiplock.worker.command), less the App argument: the backend (``--backend``, default
"default") says where the jobs are, and its QUEUES are the default ``--queues``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from skiplock.errors import ConfigurationError, SkiplockError
from skiplock.worker import command, processes
from skiplock.worker.options import WorkerOptions


class Command(BaseCommand):
    help = "Run a skiplock worker for the tasks of a SkiplockBackend."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--backend", default="default", help="the TASKS alias to run (default: default)"
        )
        parser.add_argument(
            "--queues", default=None, help="comma-separated (default: the backend's QUEUES)"
        )
        command.add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        _configure_logging(int(options["verbosity"]))
        try:
            if options["processes"] > 1:
                env = dict(os.environ)
                processes.run_fleet(_worker_program(options, env), options, env)
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
        queues = command.queue_names(options["queues"])
    else:
        queues = sorted(backend.queues) or ["default"]
    app = DjangoTasksApp(backend)
    worker_options = WorkerOptions.from_arguments(options, os.environ, queues=queues)
    worker = Worker(app, worker_options, metrics=command.serve_metrics(options, app))
    app.worker_id = str(worker.id)
    command.run_to_the_end(worker)


def _this_program(env: dict[str, str]) -> list[str]:
    """How a worker process runs this command: ``python -m django`` with this process's
    settings module and import path, whatever started this one (manage.py, django-admin,
    ``python -m django``, or call_command in a program that must not be run again)."""
    from django.conf import settings  # noqa: PLC0415

    module = getattr(settings, "SETTINGS_MODULE", None)
    if not module:
        raise ConfigurationError(
            "--processes starts worker processes with `python -m django`, which needs "
            "a settings module (DJANGO_SETTINGS_MODULE); these settings were configured "
            "in code: run single-process workers instead"
        )
    env["DJANGO_SETTINGS_MODULE"] = module
    env["PYTHONPATH"] = os.pathsep.join(path or os.getcwd() for path in sys.path)
    return [sys.executable, "-m", "django"]


def _worker_program(options: dict[str, Any], env: dict[str, str]) -> list[str]:
    """How one process of ``--processes`` starts: this command with these options (not
    this process's own command line: call_command has none) and --processes 1."""
    program = [*_this_program(env), "skiplock_worker", "--processes", "1"]
    for name in ("settings", "pythonpath"):  # Django's own, when given
        if options.get(name):
            program += [f"--{name}", str(options[name])]
    program += ["--verbosity", str(options["verbosity"]), "--backend", options["backend"]]
    return program + (["--queues", options["queues"]] if options["queues"] else [])
