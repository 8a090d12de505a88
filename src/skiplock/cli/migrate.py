"""``skiplock migrate``: apply, list or print the schema migrations, on every database of
an App's routing table with ``--app``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import psycopg

from skiplock.app import App
from skiplock.cli.databases import each_database
from skiplock.command_line import count
from skiplock.migrate import Migration, available_migrations, migrate, pending_migrations


def add_parser(sub: Any) -> None:
    p = sub.add_parser("migrate", help="apply pending schema migrations")
    p.add_argument("--status", action="store_true", help="list migrations and whether applied")
    p.add_argument("--sql", action="store_true", help="print the SQL that would run")
    p.add_argument("--target", type=count(1), default=None, help="stop at this version")
    p.add_argument(
        "--app",
        metavar="MODULE:APP",
        help="cover every database of this App's routing table (queue_databases)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for app in each_database(args):
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
