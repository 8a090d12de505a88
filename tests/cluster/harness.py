"""Several hosts on one machine: network namespaces on a private bridge, a PostgreSQL of
the harness's own in one of them, skiplock workers in the others.

The topology of one run (``RUN`` is ``skcl-<pytest pid>``)::

    RUN-net   the switch: bridge br0 and one veth end per host (named after the host)
    RUN-db    eth0 10.231.0.1/24: PostgreSQL 15 (Debian's binaries) on port 5432
    RUN-h1    eth0 10.231.0.11/24: workers
    RUN-h2    eth0 10.231.0.12/24
    RUN-h3    eth0 10.231.0.13/24

The addresses exist only inside these namespaces: the root namespace has no route to them.
The test itself reaches the server through its Unix-domain socket (a file, which network
namespaces do not separate); workers reach it over TCP, across the bridge. Cutting a host's
link sets the switch's end of its veth down: the host keeps its address and its sockets,
its packets just go nowhere, as with a pulled cable.

PostgreSQL refuses to run as root: the server runs as the system user ``skiplock_cluster``
(created when missing) from a directory under /tmp that it owns. Everything a run creates
carries its name, so a later run removes what a crashed one left behind (namespaces,
processes in them, directories) when that run's process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.conftest import ROOT, SCHEMA, Fleet, WorkerProcess

PREFIX = "skcl"
PG_BIN = Path(os.environ.get("SKIPLOCK_CLUSTER_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "skiplock_cluster"
SUBNET = "10.231.0"
DATABASE_ADDRESS = f"{SUBNET}.1"
PORT = 5432
DATABASE = "cluster"
HOSTS = ("h1", "h2", "h3")
WORKER_APP = "tests.chaos.chaos_app:app"

# The server notices a dead client in about 4 s: keepalive probes after 2 s idle, two of
# them a second apart, and tcp_user_timeout for data it sent that was never acknowledged.
# Until it does, the cut-off worker's sessions (and its liveness lock) stay.
SERVER_SETTINGS = {
    "tcp_keepalives_idle": "2",
    "tcp_keepalives_interval": "1",
    "tcp_keepalives_count": "2",
    "tcp_user_timeout": "4000",
    "max_connections": "300",
    "shared_buffers": "128MB",
    "log_line_prefix": "'%m [%p] %h %a '",
    "log_connections": "off",
}
COMMAND_TIMEOUT = 120.0


def run(command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command of the harness; a failure names it and shows its output."""
    done = subprocess.run(
        list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}")
    return done


def unavailable() -> str | None:
    """Why this machine cannot run the cluster tests, or None when it can."""
    if os.geteuid() != 0:
        return "the cluster tests need root (ip netns, veth, bridge)"
    if shutil.which("ip") is None:
        return "the cluster tests need iproute2's ip"
    if not (PG_BIN / "pg_ctl").exists():
        return f"the cluster tests need PostgreSQL's binaries in {PG_BIN} (postgresql-15)"
    if shutil.which("runuser") is None and shutil.which("setpriv") is None:
        return "the cluster tests need runuser (util-linux) to start PostgreSQL unprivileged"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"ip netns add does not work here: {made.stderr.strip()}"
    run(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    pids = run(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_leftovers() -> list[str]:
    """Namespaces, their processes and directories of earlier runs whose process is gone
    (a run killed before its finalizers ran). Returns what was removed."""
    removed = []
    pattern = re.compile(rf"^{PREFIX}-(\d+)-")
    for line in run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-*"):
        match = pattern.match(path.name)
        if match and path.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


@dataclass
class Network:
    """The run's namespaces: a switch, the database host and the worker hosts."""

    run_name: str
    hosts: tuple[str, ...] = HOSTS
    created: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.run_name}-net"

    def namespace(self, host: str) -> str:
        return f"{self.run_name}-{host}"

    def address(self, host: str) -> str:
        if host == "db":
            return DATABASE_ADDRESS
        return f"{SUBNET}.{11 + self.hosts.index(host)}"

    def _ip(self, namespace: str, *args: str) -> None:
        run(["ip", "-n", namespace, *args])

    def create(self) -> None:
        self._add(self.switch)
        self._ip(self.switch, "link", "add", "br0", "type", "bridge")
        self._ip(self.switch, "link", "set", "br0", "up")
        self._ip(self.switch, "link", "set", "lo", "up")
        for host in ("db", *self.hosts):
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
            self._ip(namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
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
        for host in self.hosts:
            self.restore(host)

    def destroy(self) -> None:
        for namespace in reversed(self.created):
            _kill_namespace_processes(namespace)
            run(["ip", "netns", "del", namespace], check=False)
        self.created.clear()


def _ensure_user() -> None:
    if run(["id", "-u", PG_USER], check=False).returncode != 0:
        run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER])


def _as_user(command: Sequence[str]) -> list[str]:
    if shutil.which("runuser"):
        return ["runuser", "-u", PG_USER, "--", *command]
    return ["setpriv", "--reuid", PG_USER, "--regid", PG_USER, "--init-groups", *command]


@dataclass
class Server:
    """The run's PostgreSQL, in the database host's namespace."""

    network: Network
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "socket"

    @property
    def url(self) -> str:
        """For workers: over TCP, across the bridge."""
        return f"postgresql://postgres@{DATABASE_ADDRESS}:{PORT}/{DATABASE}"

    def local_url(self, database: str = DATABASE) -> str:
        """For the test: the Unix-domain socket, reachable from the root namespace."""
        return f"host={self.socket_dir} port={PORT} user=postgres dbname={database}"

    def create(self) -> None:
        _ensure_user()
        self.socket_dir.mkdir()
        shutil.chown(self.root, PG_USER, PG_USER)
        shutil.chown(self.socket_dir, PG_USER, PG_USER)
        run(
            _as_user(
                [
                    str(PG_BIN / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ]
            )
        )
        settings = {
            "listen_addresses": f"'{DATABASE_ADDRESS}'",
            "port": str(PORT),
            "unix_socket_directories": f"'{self.socket_dir}'",
            **SERVER_SETTINGS,
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\n# skiplock cluster harness\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET}.0/24 trust\n")

    def pg_ctl(self, *args: str) -> None:
        command = _as_user([str(PG_BIN / "pg_ctl"), "-D", str(self.data), *args])
        # A file, not a pipe, for the output: the postmaster would hold a pipe open.
        with tempfile.TemporaryFile() as out:
            done = subprocess.run(
                ["ip", "netns", "exec", self.network.namespace("db"), *command],
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

    def log(self) -> str:
        path = self.root / "log"
        return path.read_text(errors="replace") if path.exists() else ""


class Cluster:
    """A run's network and server: ``up`` builds both, ``down`` removes everything, and
    is safe to call on a half-built cluster."""

    def __init__(self) -> None:
        self.run_name = f"{PREFIX}-{os.getpid()}"
        self.network = Network(self.run_name)
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.run_name}-"))
        self.server = Server(self.network, self.root)

    def up(self) -> None:
        self.network.create()
        self.server.create()
        self.server.start()

    def down(self) -> None:
        try:
            self.server.stop()
        except (RuntimeError, subprocess.TimeoutExpired):
            pass  # its processes die with the namespace below
        finally:
            self.network.destroy()
            shutil.rmtree(self.root, ignore_errors=True)


class HostFleet(Fleet):
    """Chaos's fleet of worker processes, each started inside a host's namespace."""

    def __init__(self, cluster: Cluster, logs: Path) -> None:
        super().__init__(cluster.server.url, logs)
        self.cluster = cluster
        self.host_of: dict[int, str] = {}

    def start_on(
        self,
        host: str,
        *,
        concurrency: int = 8,
        lease: float = 30.0,
        tcp_user_timeout: float = 4.0,
        poll_interval: float = 1.0,
        shutdown_timeout: float = 10.0,
        prefetch: str = "auto",
        queues: str = "chaos",
    ) -> WorkerProcess:
        """Start ``skiplock worker`` in ``host``'s namespace (``ip netns exec`` execs, so
        the process's pid is the worker's); it is not waited for."""
        command = [
            "ip",
            "netns",
            "exec",
            self.cluster.network.namespace(host),
            sys.executable,
            "-m",
            "skiplock",
            "--database-url",
            self.url,
            "--schema",
            SCHEMA,
            "worker",
            WORKER_APP,
            "--queues",
            queues,
            "--concurrency",
            str(concurrency),
            "--lease",
            str(lease),
            "--poll-interval",
            str(poll_interval),
            "--shutdown-timeout",
            str(shutdown_timeout),
            "--tcp-user-timeout",
            str(tcp_user_timeout),
            "--prefetch",
            prefetch,
        ]
        appname = f"skiplock-{host}-{len(self.workers)}"
        log_path = self.logs / f"{appname}.log"
        env = {**os.environ, "PGAPPNAME": appname, "PYTHONFAULTHANDLER": "1"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        worker = WorkerProcess(proc, appname, log_path)
        self.workers.append(worker)
        self.host_of[worker.pid] = host
        self.record("start", worker.pid, host)
        return worker

    def on_host(self, host: str) -> list[WorkerProcess]:
        return [w for w in self.workers if self.host_of.get(w.pid) == host]

    def start_hosts(
        self, per_host: int, conn: Any, *, hosts: Sequence[str] = HOSTS, **options: Any
    ) -> None:
        started = [self.start_on(host, **options) for host in hosts for _ in range(per_host)]
        self.wait_registered(conn, started)
