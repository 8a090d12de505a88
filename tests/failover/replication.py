"""A primary and a streaming standby on hosts of the cluster harness (tests/cluster).

The topology of one run (``RUN`` is ``skcl-<pytest pid>-fo``), on the harness's bridge::

    RUN-db       eth0 10.231.0.1/24: the primary (PostgreSQL 15, port 5432)
    RUN-standby  eth0 10.231.0.2/24: its standby, made by pg_basebackup -R from it
    RUN-h1       eth0 10.231.0.11/24: workers and the enqueuing client
    RUN-h2       eth0 10.231.0.12/24: workers

Clients on the hosts name both servers in one libpq multi-host URL with
``target_session_attrs=read-write``: libpq tries them in order and keeps the first that
accepts writes, so after the standby's promotion a reconnect lands on it, and a standby
still in recovery is passed over.

The standby is built with ``synchronous_standby_names`` empty in its own configuration:
once promoted it has no standby of its own, and a primary that names a missing
synchronous standby makes every commit wait for ever. The primary names the standby (its
``application_name``) for synchronous replication, or nobody for asynchronous.

The harness's files are the other helper's; what differs here (a server per host, a
second database host, a URL naming both) is in subclasses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from chaos.conftest import wait_until
from cluster.harness import (
    COMMAND_TIMEOUT,
    DATABASE,
    PG_BIN,
    PG_USER,
    PORT,
    PREFIX,
    SUBNET,
    Cluster,
    HostFleet,
    Network,
    Server,
    _as_user,
    _ensure_user,
    _kill_namespace_processes,
    run,
    unavailable,
)

STANDBY = "standby"
STANDBY_ADDRESS = f"{SUBNET}.2"
WORKER_HOSTS = ("h1", "h2")
# Per host tried: a host that is down (rather than its server) would otherwise hold each
# connection attempt for the kernel's SYN retries, about two minutes.
CONNECT_TIMEOUT = 3
REPLICATION_PATIENCE = 60.0
PROMOTION_POLL = 0.005


def failover_unavailable() -> str | None:
    """Why this machine cannot build the primary and standby, or None when it can."""
    reason = unavailable()
    if reason is None and not (PG_BIN / "pg_basebackup").exists():
        reason = f"the failover tests need pg_basebackup in {PG_BIN} (postgresql-15)"
    return reason


@dataclass
class FailoverNetwork(Network):
    """The harness's network with a second database host, the standby's."""

    hosts: tuple[str, ...] = (STANDBY, *WORKER_HOSTS)

    def address(self, host: str) -> str:
        if host == STANDBY:
            return STANDBY_ADDRESS
        if host in WORKER_HOSTS:
            return f"{SUBNET}.{11 + WORKER_HOSTS.index(host)}"
        return super().address(host)


@dataclass
class Node(Server):
    """A PostgreSQL in its own host's namespace and directory (the harness's Server is
    always the host "db")."""

    host: str = "db"

    @property
    def address(self) -> str:
        return self.network.address(self.host)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.address}:{PORT}/{DATABASE}"

    def pg_ctl(self, *args: str) -> None:
        command = _as_user([str(PG_BIN / "pg_ctl"), "-D", str(self.data), *args])
        # A file, not a pipe, for the output: the postmaster would hold a pipe open.
        with tempfile.TemporaryFile() as out:
            done = subprocess.run(
                ["ip", "netns", "exec", self.network.namespace(self.host), *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=COMMAND_TIMEOUT,
                check=False,
            )
            if done.returncode != 0:
                out.seek(0)
                raise RuntimeError(f"pg_ctl {args} failed:\n{out.read().decode(errors='replace')}")

    def power_off(self) -> None:
        """SIGKILL every process of the server's host, as a machine that dies: no
        checkpoint, no goodbye to clients or standby, WAL not yet sent stays unsent."""
        _kill_namespace_processes(self.network.namespace(self.host))

    def promote(self) -> datetime:
        """End recovery (``pg_promote``); returns when the server was first seen accepting
        writes, within PROMOTION_POLL (pg_ctl's own wait polls ten times slower)."""
        with psycopg.connect(self.local_url(), autocommit=True) as conn:
            conn.execute("SELECT pg_promote(wait => false)")

            def promoted() -> bool:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                return row is not None and row[0] is False

            wait_until(promoted, REPLICATION_PATIENCE, PROMOTION_POLL, what="the promotion")
            return datetime.now(UTC)

    def create_primary(self) -> None:
        """initdb, as the harness does, and let the subnet's hosts stream from it."""
        self.root.mkdir()
        self.create()
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host replication all {SUBNET}.0/24 trust\n")
        # Commit times, for the gap from the promotion to the first completion on the new
        # primary (job_history's own finished_at is its transaction's start).
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("track_commit_timestamp = on\n")

    def create_standby(self, primary: Node) -> None:
        """pg_basebackup -R from ``primary``, run on this node's host as the server's user,
        so that the standby streams under its host's name as ``application_name``."""
        _ensure_user()
        self.root.mkdir()
        self.socket_dir.mkdir()
        shutil.chown(self.root, PG_USER, PG_USER)
        shutil.chown(self.socket_dir, PG_USER, PG_USER)
        source = f"host={primary.address} port={PORT} user=postgres application_name={self.host}"
        backup = [str(PG_BIN / "pg_basebackup"), "-D", str(self.data), "-R", "-X", "stream"]
        run(
            [
                "ip",
                "netns",
                "exec",
                self.network.namespace(self.host),
                *_as_user([*backup, "-c", "fast", "--no-sync", "-d", source]),
            ]
        )
        settings = {
            "listen_addresses": f"'{self.address}'",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "synchronous_standby_names": "''",
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\n# skiplock failover harness: the standby's own\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())


class FailoverCluster(Cluster):
    """The network, a primary on "db" and its standby on "standby"; ``up`` builds them,
    ``down`` removes everything, and is safe to call on a half-built cluster."""

    def __init__(self, prepare: Callable[[str], None], *, synchronous: bool) -> None:
        self.prepare = prepare
        self.synchronous = synchronous
        # Its own run name, so that a pytest run with the cluster tests never reuses
        # their namespaces; the harness's leftover sweep still recognises it by the pid.
        self.run_name = f"{PREFIX}-{os.getpid()}-fo"
        self.network = FailoverNetwork(self.run_name)
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.run_name}-"))
        self.primary = Node(self.network, self.root / "primary", "db")
        self.standby = Node(self.network, self.root / STANDBY, STANDBY)
        self.server = self.primary

    @property
    def url(self) -> str:
        """Both servers, the writable one wherever it is."""
        hosts = ",".join(f"{node.address}:{PORT}" for node in (self.primary, self.standby))
        return (
            f"postgresql://postgres@{hosts}/{DATABASE}"
            f"?target_session_attrs=read-write&connect_timeout={CONNECT_TIMEOUT}"
        )

    def up(self) -> None:
        """Network and primary; ``prepare(local_url)`` sets the database up on the
        primary alone; then the standby is copied from it, and streaming, synchronous or
        not, before this returns."""
        self.network.create()
        _ensure_user()
        shutil.chown(self.root, PG_USER, PG_USER)  # the servers' directories are in it
        self.primary.create_primary()
        self.primary.start()
        self.prepare(self.primary.local_url())
        self.standby.create_standby(self.primary)
        self.standby.start()
        synchronous = self.synchronous
        names = STANDBY if synchronous else ""
        with psycopg.connect(self.primary.local_url("postgres"), autocommit=True) as admin:
            admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
            admin.execute("SELECT pg_reload_conf()")
            wanted = "sync" if synchronous else "async"

            def streaming() -> bool:
                row = admin.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (STANDBY,),
                ).fetchone()
                return row == ("streaming", wanted)

            wait_until(streaming, REPLICATION_PATIENCE, 0.1, what=f"{wanted} streaming")

    def down(self) -> None:
        try:
            for node in (self.standby, self.primary):
                # A node powered off leaves its pid file: pg_ctl then fails, and whatever
                # still runs dies with the namespace below.
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    node.stop()
        finally:
            self.network.destroy()
            shutil.rmtree(self.root, ignore_errors=True)


class FailoverFleet(HostFleet):
    """The harness's worker fleet, on the URL that names both servers."""

    def __init__(self, cluster: FailoverCluster, logs: Path) -> None:
        super().__init__(cluster, logs)
        self.url = cluster.url
