"""``skiplock signal``: send a durable wait's signal by hand (an operator approving, a
script, a test), as ``App.signal`` sends it from code."""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from typing import Any

from skiplock.app import App
from skiplock.command_line import count
from skiplock.errors import ConfigurationError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "signal",
        help="send a signal: the oldest job waiting for KEY resumes with PAYLOAD",
        description="Commits at once. With no job waiting for KEY, the signal is kept for "
        "the next wait (skiplock.wait_for) of that key.",
    )
    p.add_argument("key", metavar="KEY")
    p.add_argument(
        "payload", metavar="PAYLOAD", nargs="?", default="null", help="JSON (default: null)"
    )
    p.add_argument(
        "--keep-days",
        type=count(1, 3650),
        default=7,
        metavar="DAYS",
        help="keep an unheard signal this long (default: %(default)s)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except ValueError as exc:
        raise ConfigurationError(f"PAYLOAD must be JSON ({exc}), got {args.payload!r}") from None
    app = App(
        args.database_url, schema=args.schema, signal_retention=timedelta(days=args.keep_days)
    )
    with app.connect() as conn:
        resumed = app.signal(conn, args.key, payload)
        conn.commit()
    if resumed is None:
        print(
            f"signal {args.key!r} kept: no job waits for it yet; the next wait for it takes "
            f"it (kept {args.keep_days} days at most)"
        )
    else:
        print(f"signal {args.key!r} sent: job {resumed} resumes")
    return 0
