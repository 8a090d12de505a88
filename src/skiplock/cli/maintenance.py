"""``skiplock doctor``, ``prune`` and ``grant``: check the database, keep its history
partitions, and give roles what they need."""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from typing import Any

from skiplock.app import App
from skiplock.command_line import RETENTION_DAYS, seconds
from skiplock.config import DEFAULT_SCHEMA, SCHEMA_ENV


def add_parser(sub: Any) -> None:
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
    p.set_defaults(func=run_doctor)

    p = sub.add_parser(
        "prune",
        help="create history partitions ahead and drop those past retention "
        "(the worker's leader does this every minute)",
    )
    p.add_argument("--retention-days", type=RETENTION_DAYS, default=7.0)
    p.add_argument("--keep-forever", action="store_true", help="only create partitions")
    p.set_defaults(func=run_prune)

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
    p.set_defaults(func=run_grant)


def run_doctor(args: argparse.Namespace) -> int:
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


def run_prune(args: argparse.Namespace) -> int:
    from skiplock import history  # noqa: PLC0415

    app = App(args.database_url, schema=args.schema)
    retention = None if args.keep_forever else timedelta(days=args.retention_days)
    with app.connect(autocommit=True) as conn:
        report = history.maintain(conn, app.schema, retention=retention)
    print(
        f"history partitions created: {', '.join(report.created) or 'none'}; "
        f"dropped: {', '.join(report.dropped) or 'none'}; "
        f"rows pruned from the default partition: {report.pruned_rows}; "
        f"ended workflows pruned: {report.pruned_workflows}; "
        f"steps of ended jobs pruned: {report.pruned_steps}; "
        f"expired signals deleted: {report.expired_signals}"
        + (f"; skipped (locked or in use): {', '.join(report.skipped)}" if report.skipped else "")
    )
    return 0


def run_grant(args: argparse.Namespace) -> int:
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
