"""``skiplock embedded``: the embedded PostgreSQL's URL and status, or stop it."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
