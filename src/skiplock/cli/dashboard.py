"""``skiplock dashboard``: serve the dashboard with uvicorn.

The CLI resolves --database-url, --database-url-env and --schema as for every command and
parses the global --read-url (left for this command to use: the pages read there, the
actions still go to --database-url); this module only adds the dashboard's own options.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from skiplock.app import App
from skiplock.cli.databases import app_from_args
from skiplock.command_line import PORT
from skiplock.config import DEFAULT_SCHEMA, SCHEMA_ENV, resolve_database_url
from skiplock.dashboard import security
from skiplock.errors import ConfigurationError
from skiplock.replica import READ_URL_ENV
from skiplock.routing import describe_url

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8089

log = logging.getLogger("skiplock.dashboard")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``dashboard`` to the CLI's subcommands."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "dashboard",
        help="serve the web dashboard (needs the dashboard extra)",
        description=(
            "Serve the web dashboard. On an address other machines can reach, actions need "
            f"${security.TOKEN_ENV} (or --read-only). See docs/dashboard.md."
        ),
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to listen on (default %(default)s: this machine only)",
    )
    parser.add_argument("--port", type=PORT, default=DEFAULT_PORT, help="default %(default)s")
    parser.add_argument(
        "--read-only", action="store_true", help="show everything, change nothing (no actions)"
    )
    parser.add_argument(
        "--root-path",
        default="",
        metavar="PREFIX",
        help="the path prefix a reverse proxy serves the dashboard under, e.g. /queue",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name the dashboard is reached by (repeat for several; also "
        f"${security.ALLOWED_HOSTS_ENV}, comma-separated): requests for any other name than "
        "localhost, an IP address or --host are refused (DNS rebinding)",
    )
    parser.add_argument(
        "--app",
        default=None,
        metavar="MODULE:APP",
        help="the skiplock App: cron expressions and next fire times, and every database "
        "of its routing table (queue_databases)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the options, then serve until interrupted."""
    try:
        import uvicorn  # noqa: PLC0415

        from skiplock.dashboard.web import create_app  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigurationError(
            f"the dashboard needs its extra ({exc.name} is missing): "
            "pip install 'skiplock[dashboard]'"
        ) from None
    token = os.environ.get(security.TOKEN_ENV) or None
    security.check_startup(args.host, token=token, read_only=args.read_only)
    if not 1 <= args.port <= 65535:
        raise ConfigurationError(f"--port {args.port}: use 1 to 65535")
    read_url = getattr(args, "read_url", None) or os.environ.get(READ_URL_ENV) or None
    app, database_url, schema = _database(args)
    allowed = _allowed_hosts(args)
    web = create_app(
        database_url,
        schema,
        read_url=read_url,
        read_only=args.read_only,
        root_path=args.root_path,
        token=token,
        app=app,
        allowed_hosts=allowed,
    )
    mode = "read-only" if args.read_only else ("token required" if token else "no token")
    log.info(
        "dashboard on http://%s:%d%s/ (%s, schema %s%s)",
        args.host,
        args.port,
        args.root_path,
        mode,
        schema,
        f", pages read from {describe_url(read_url)}" if read_url else "",
    )
    uvicorn.run(web, host=args.host, port=args.port, log_level="warning", proxy_headers=True)
    return 0


def _database(args: argparse.Namespace) -> tuple[App | None, str, str]:
    """The App (with ``--app``), the database URL and the schema the dashboard shows."""
    if not args.app:
        schema = args.schema or os.environ.get(SCHEMA_ENV) or DEFAULT_SCHEMA
        return None, resolve_database_url(args.database_url), schema
    # As `skiplock status --app`: --database-url and --schema, when given, override the
    # App's own; its routing table brings its other databases (and create_app refuses a
    # read URL with them, as status does: replica.check_one_database).
    app = app_from_args(args)
    return app, app.database_url, app.schema


def _allowed_hosts(args: argparse.Namespace) -> list[str]:
    """The names the dashboard is reached by: --host when it is one (an address needs no
    listing), --allowed-host and the environment's."""
    from_env = os.environ.get(security.ALLOWED_HOSTS_ENV, "").replace(",", " ").split()
    allowed = [*args.allowed_host, *from_env]
    if not security.is_ip_address(args.host):
        allowed.append(args.host)
    return allowed
