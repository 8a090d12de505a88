"""The bench's worker processes: real ``skiplock worker`` processes over the bench's app,
on this machine or on hosts of a topology, started and registered before a scenario
measures, stopped afterwards."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.topology import Network
from skiplock.demo import worker_command, worker_env

# Extra arguments for every bench worker process (``bench --worker-args``), for A/B runs
# of a setting; empty means the worker's defaults.
WORKER_ARGS: list[str] = []
# The worker's default slots: the idle or busy single worker of the commit-path scenarios.
WORKER_SLOTS = 10


@dataclass(frozen=True)
class Placement:
    """Bench workers on hosts of a topology (skiplock.bench.topology): ``processes`` on
    each of ``hosts``, reaching the server at ``url`` across the topology's bridge."""

    network: Network
    hosts: tuple[str, ...]
    url: str


@contextmanager
def worker_processes(
    url: str,
    schema: str,
    processes: int,
    concurrency: int,
    extra_args: Sequence[str] = (),
    *,
    placement: Placement | None = None,
    logs: Path | None = None,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start ``processes`` worker processes (on each host of ``placement``, if given) and
    wait until each has registered; with ``logs``, each one's output goes to a file there.
    The URL goes in their environment (demo.worker_env), never on a command line."""
    env = worker_env(url if placement is None else placement.url, schema)
    command = worker_command(
        schema,
        "skiplock.bench:app",
        *("--concurrency", str(concurrency), "--poll-interval", "0.5"),
        *extra_args,
        *WORKER_ARGS,
    )
    commands = (
        [command] * processes
        if placement is None
        else [
            placement.network.run_in(h, command) for h in placement.hosts for _ in range(processes)
        ]
    )
    children = []
    for index, argv in enumerate(commands):
        out: Any = subprocess.DEVNULL
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            out = (logs / f"worker-{index}.log").open("wb")
        try:
            children.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
        finally:
            if logs is not None:
                out.close()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "workers"))
            while True:
                row = conn.execute(query).fetchone()
                if row is not None and row[0] >= len(children):
                    break
                if time.monotonic() > deadline or any(c.poll() is not None for c in children):
                    raise RuntimeError("bench worker processes did not start")
                time.sleep(0.05)
        yield children
    finally:
        stop_processes(children)


def stop_processes(children: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop worker processes as a deploy would (SIGTERM, then SIGKILL after 30 s)."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
