"""The databases a command acts on: the URLs it was given (from the environment when
named there, checked before connecting, hidden from what it prints) and the Apps they
make."""

from __future__ import annotations

import argparse
import os
import sys

import psycopg
import psycopg.conninfo

import skiplock.app
from skiplock import pooler, routing
from skiplock.app import App
from skiplock.config import DATABASE_URL_ENV
from skiplock.errors import ConfigurationError
from skiplock.replica import READ_URL_ENV, check_one_database, replica_state


def app_from_args(args: argparse.Namespace) -> App:
    if getattr(args, "app", None):
        # Looked up on the module when called, so that a test can stand in an App.
        app = skiplock.app.load_app(args.app)
        app.configure(database_url=args.database_url, schema=args.schema)
        return app
    return App(args.database_url, schema=args.schema)


def each_database(args: argparse.Namespace) -> list[App]:
    """``--app MODULE:APP``: one App per database of its routing table (queue_databases),
    its database_url first; without it, the one database of --database-url."""
    if not getattr(args, "app", None):
        return [App(args.database_url, schema=args.schema)]
    app = app_from_args(args)
    check_one_database(getattr(args, "read_url", None) or os.environ.get(READ_URL_ENV), app)
    return [app._for_database(url) for url in app.databases()]


def read_from_replica(args: argparse.Namespace) -> None:
    """status and jobs list/show read from --read-url ($SKIPLOCK_READ_URL) when given,
    and say on stderr how far behind it is: what they show is that old."""
    read_url = args.read_url or os.environ.get(READ_URL_ENV)
    reads = args.command == "status" or getattr(args, "jobs_command", None) in ("list", "show")
    if not read_url or not reads:
        return
    with psycopg.connect(read_url, autocommit=True) as conn:
        print(f"skiplock: {replica_state(conn).describe()}", file=sys.stderr)
    args.database_url = read_url


def database_url_from_env(args: argparse.Namespace) -> None:
    """--database-url-env NAME: the URL is NAME's value, as if given with --database-url."""
    name = args.database_url_env
    if not name:
        return
    if args.database_url:
        raise ConfigurationError("give --database-url or --database-url-env, not both")
    args.database_url = os.environ.get(name)
    if not args.database_url:
        raise ConfigurationError(f"--database-url-env {name}: ${name} is not set")


def given_urls(args: argparse.Namespace) -> list[tuple[str, str]]:
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


def check_database_urls(args: argparse.Namespace) -> None:
    for origin, url in given_urls(args):
        routing.check_database_url(url, origin)
