"""Debian's PgBouncer in transaction pooling mode, in front of the test server.

Started from a configuration in a directory of its own, on a free port, as a non-root
user (PgBouncer refuses to run as root: as ``postgres`` when the tests run as root), and
stopped at the end. ``* = host=… port=…`` forwards every database to the test server;
``auth_type = trust`` lets every role listed in ``auth_file`` in (the test server trusts
127.0.0.1 too). ``BouncerUnavailableError`` says why it could not start: the tests skip with
that reason.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

START_SECONDS = 10.0
# Enough server connections for a few workers with their pools and the test's own; the
# tests that need a pool of one server connection use a database entry of their own.
POOL_SIZE = 40
# The database entry whose pool holds a single server connection.
SINGLE = "single_"


class BouncerUnavailableError(Exception):
    """PgBouncer is not installed or did not start; the message says which."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PgBouncer:
    """``start(server_url)``, then ``url(database_url)`` for a URL through it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="skiplock-pgbouncer-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.version = ""

    def start(self, server_url: str, users: list[str], databases: list[str]) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(binary):
            raise BouncerUnavailableError(
                "pgbouncer is not installed (apt-get install -y pgbouncer; scripts/test does)"
            )
        server = conninfo_to_dict(server_url)
        host, port = server.get("host") or "127.0.0.1", server.get("port") or "5432"
        # A database entry with a pool of one server connection per database under test
        # (the pooler-detection test), besides the wildcard.
        singles = "".join(
            f"{SINGLE}{name} = host={host} port={port} dbname={name} pool_size=1\n"
            for name in databases
        )
        (self.directory / "users.txt").write_text("".join(f'"{u}" ""\n' for u in users))
        (self.directory / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"{singles}"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.directory / 'users.txt'}\n"
            "pool_mode = transaction\n"
            "max_client_conn = 1000\n"
            f"default_pool_size = {POOL_SIZE}\n"
            f"logfile = {self.directory / 'pgbouncer.log'}\n"
        )
        command = [binary, str(self.directory / "pgbouncer.ini")]
        as_user: dict[str, Any] = {}
        if os.geteuid() == 0:
            # PgBouncer refuses root: run it as the server's own system user.
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise BouncerUnavailableError(
                    "running as root and there is no postgres user"
                ) from None
            os.chown(self.directory, owner.pw_uid, owner.pw_gid)
            for path in self.directory.iterdir():
                os.chown(path, owner.pw_uid, owner.pw_gid)
            as_user = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
        version = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True)
        self.version = version.stdout.splitlines()[0] if version.stdout else "?"
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            **as_user,
        )
        deadline = time.monotonic() + START_SECONDS
        probe = self.url(server_url)
        while True:
            try:
                with psycopg.connect(probe, autocommit=True, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise BouncerUnavailableError(
                    f"pgbouncer did not start; its log ends: {log[-600:]}"
                )
            time.sleep(0.1)

    def url(self, database_url: str, *, single: bool = False) -> str:
        """``database_url`` through the pooler (``single``: through the pool that has one
        server connection)."""
        params = {k: str(v) for k, v in conninfo_to_dict(database_url).items() if v is not None}
        params.update(host="127.0.0.1", port=str(self.port))
        if single:
            params["dbname"] = SINGLE + params["dbname"]
        return make_conninfo("", **params)

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else "(no log)"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
