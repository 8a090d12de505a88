"""``skiplock cron``: list, pause, resume and run now the cron schedules workers tick, from
the descriptions they write (migration 0030): no App needed."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

from skiplock.admin import Admin
from skiplock.app import App


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cron", help="list, pause, resume or run now the cron schedules")
    cron = p.add_subparsers(dest="cron_command", required=True)
    q = cron.add_parser("list", help="every schedule a worker ticks, with its next tick")
    q.add_argument("--json", action="store_true")
    for name, text in (
        ("pause", "stop a schedule's ticks enqueueing jobs (none are owed on resume)"),
        ("resume", "let a paused schedule enqueue its ticks again"),
        ("run-now", "enqueue a schedule's job now, paused or not; its ticks go on"),
    ):
        q = cron.add_parser(name, help=text)
        q.add_argument("name", metavar="NAME", help="the schedule's name: its task's")
    p.set_defaults(func=run)


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def schedule_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line a schedule, for ``cron list``. Pure."""
    if not rows:
        return ["no cron schedules: a worker records its App's when it starts"]
    width = max(len(str(row["name"])) for row in rows)
    lines = [f"{'schedule':<{width}}  {'expression':<15} {'queue':<12} next tick / last tick"]
    for row in rows:
        state = "  PAUSED" if row["paused"] else ""
        lines.append(
            f"{row['name']:<{width}}  {row['expression'] or '?':<15} {row['queue'] or '?':<12} "
            f"{_when(row['next_tick'])} / {_when(row['last_tick'])}{state}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    app = App(args.database_url, schema=args.schema)
    with app.connect(autocommit=True) as conn:
        admin = Admin(app, conn)
        command = args.cron_command
        if command == "list":
            rows = admin.schedules()
            if args.json:
                print(json.dumps(rows, default=str))
            else:
                print("\n".join(schedule_table(rows)))
            return 0
        if command == "run-now":
            job_id = admin.run_schedule_now(args.name)
            print(f"schedule {args.name}: job {job_id} enqueued now")
            return 0
        if command == "pause":
            admin.pause_schedule(args.name)
            print(f"schedule {args.name} paused: its ticks enqueue nothing until resumed")
            return 0
        admin.resume_schedule(args.name)
        print(f"schedule {args.name} resumed: its next tick enqueues its job")
        return 0
