"""``skiplock queues``: pause, resume, limit and list queues."""

from __future__ import annotations

import argparse
from typing import Any

from skiplock.admin import Admin
from skiplock.app import App
from skiplock.command_line import CONCURRENCY
from skiplock.tasks import parse_rate
from skiplock.types import LIVE_STATES


def add_parser(sub: Any) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    app = App(args.database_url, schema=args.schema)
    with app.connect(autocommit=True) as conn:
        admin = Admin(app, conn)
        if args.queues_command == "list":
            print("\n".join(queue_table(admin.queue_stats(), admin.queue_settings())))
            return 0
        if args.queues_command == "limit":
            rate = parse_rate(args.rate) if args.rate else None
            admin.set_queue_limits(args.queue, concurrency=args.concurrency, rate=rate)
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
        if paused:
            admin.pause_queue(args.queue)
        else:
            admin.resume_queue(args.queue)
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
        live = sum(row.get(state, 0) for state in LIVE_STATES)
        lines.append(
            f"{name:<{width}}{'paused' if setting.get('paused') else 'active':<8}"
            f"{ready:>7}{row.get('running', 0):>9}{live:>7}{row.get('workers', 0):>9}  "
            + (_limits_text(setting) or "-")
        )
    return lines
