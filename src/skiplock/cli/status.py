"""``skiplock status``: per queue its depth, oldest ready age, running, dead and last
minute, and the workers; exits 1 when a threshold given is crossed (an alert check)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from skiplock import routing
from skiplock.admin import Admin
from skiplock.app import App
from skiplock.cli.databases import each_database
from skiplock.command_line import count, seconds
from skiplock.sql import render
from skiplock.sql import signals as signal_sql
from skiplock.wording import plural

# The options that set an alert's threshold, named as status_alerts' keywords.
THRESHOLDS = ("max_dead", "max_available", "max_ready_age", "min_workers")


def add_parser(sub: Any) -> None:
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
    p.set_defaults(func=run)


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
                f"queue {name}: {plural(row['dead'], 'dead job')} (more than {max_dead}); "
                f"see `skiplock jobs list --state dead --queue {name}`"
            )
        if max_available is not None and row["available"] > max_available:
            alerts.append(
                f"queue {name}: {plural(row['available'], 'job')} ready (more than {max_available})"
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
    queues: list[dict[str, Any]],
    workers: list[dict[str, Any]],
    notes: list[str],
    signals: tuple[int, int] = (0, 0),
) -> None:
    print(
        f"{'queue':<16}{'waiting':>8}{'blocked':>8}{'available':>10}{'scheduled':>10}{'running':>8}"
        f"{'retryable':>10}"
        f"{'dead':>6}{'oldest ready':>13}{'done/1m':>9}{'failed/1m':>10}{'workers':>8}"
    )
    for row in queues:
        oldest = row["oldest_ready_seconds"]
        print(
            f"{row['queue']:<16}{row['waiting']:>8}{row['blocked']:>8}{row['available']:>10}{row['scheduled']:>10}"
            f"{row['running']:>8}{row['retryable']:>10}{row['dead']:>6}"
            f"{(f'{oldest:.1f}s' if oldest is not None else '-'):>13}"
            f"{row['completed_last_minute']:>9}{row['failed_last_minute']:>10}"
            f"{row['workers']:>8}" + ("  paused" if row.get("paused") else "")
        )
    if not queues:
        print("(no jobs and no workers)")
    if any(signals):
        print(f"waiting for signals: {signals[0]}; signals kept: {signals[1]}")
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


def run(args: argparse.Namespace) -> int:
    apps = each_database(args)
    several = len(apps) > 1
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(app.connect(autocommit=True)) for app in apps]
        while True:
            each = zip(apps, conns, strict=True)
            sections = [_read(app, conn, several=several) for app, conn in each]
            alerts = [alert for section in sections for alert in _alerts(section, args)]
            if args.json:
                _print_json(sections, alerts)
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")  # clear the terminal, cursor home
                for section in sections:
                    if section.database is not None:
                        print(f"database {section.database}")
                    _print_status(section.queues, section.workers, section.notes, section.signals)
                    if section.database is not None:
                        print()
                for alert in alerts:
                    print(f"ALERT: {alert}", file=sys.stderr)
            if not args.watch:
                return 1 if alerts else 0
            time.sleep(args.watch)


@dataclass
class _Section:
    """What status shows of one database; ``database`` names it when there are several."""

    database: str | None
    queues: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    notes: list[str]
    # Jobs waiting for a signal, and signals kept for a wait to come.
    signals: tuple[int, int] = (0, 0)


def _read(app: App, conn: psycopg.Connection[Any], *, several: bool) -> _Section:
    admin = Admin(app, conn)
    queues = admin.queue_stats()
    paused = set(admin.paused_queues())
    for row in queues:
        row["paused"] = row["queue"] in paused
    workers = admin.workers()
    where = routing.describe_url(app.database_url) if several else None
    if where is not None:  # which database each row is from
        for row in [*queues, *workers]:
            row["database"] = where
    counted = conn.execute(render(signal_sql.SIGNALS_COUNT, app.schema)).fetchone()
    signals = (int(counted[0]), int(counted[1])) if counted else (0, 0)
    return _Section(where, queues, workers, status_notes(queues, workers), signals)


def _alerts(section: _Section, args: argparse.Namespace) -> list[str]:
    thresholds = {name: getattr(args, name) for name in THRESHOLDS}
    found = status_alerts(section.queues, section.workers, **thresholds)
    where = section.database
    return [alert if where is None else f"{where}: {alert}" for alert in found]


def _print_json(sections: list[_Section], alerts: list[str]) -> None:
    every = {
        "queues": [row for section in sections for row in section.queues],
        "workers": [row for section in sections for row in section.workers],
        "alerts": alerts,
        "notes": [note for section in sections for note in section.notes],
        "waiting_for_signals": sum(section.signals[0] for section in sections),
        "signals_kept": sum(section.signals[1] for section in sections),
    }
    print(json.dumps(every, default=str), flush=True)
