"""Worker fleets on the hosts of a ``skiplock.bench.topology.Topology``: network namespaces
on a private bridge, a PostgreSQL of the run's own in one of them
(skiplock/bench/topology.py describes the layout), skiplock workers in the others.

The test itself reaches the server through its Unix-domain socket; workers reach it over
TCP, across the bridge.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chaos.conftest import SCHEMA, Fleet
from processes import WorkerProcess, spawn_worker_process
from skiplock.bench.topology import Topology, worker_hosts

HOSTS = tuple(worker_hosts(3))
WORKER_APP = "tests.chaos.chaos_app:app"


class HostFleet(Fleet):
    """Chaos's fleet of worker processes, each started inside a host's namespace."""

    def __init__(self, cluster: Topology, logs: Path) -> None:
        super().__init__(cluster.url, logs)
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
        appname = f"skiplock-{host}-{len(self.workers)}"
        worker = spawn_worker_process(
            self.url,
            WORKER_APP,
            *("--queues", queues, "--concurrency", str(concurrency)),
            *("--lease", str(lease), "--poll-interval", str(poll_interval)),
            *("--shutdown-timeout", str(shutdown_timeout)),
            *("--tcp-user-timeout", str(tcp_user_timeout), "--prefetch", prefetch),
            schema=SCHEMA,
            appname=appname,
            log_path=self.logs / f"{appname}.log",
            wrap=lambda command: self.cluster.network.run_in(host, command),
        )
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
