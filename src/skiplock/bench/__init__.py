"""``skiplock bench``: throughput and latency scenarios, each figure the median of several
runs.

Each scenario is a module of this package (``SCENARIOS``), imported only when chosen, with
a ``scenario(name, settings, report)`` function; what they share is in ``measure``
(settings, figures, the report, CPU per job), ``load`` (scratch schemas, jobs),
``workers`` (real ``skiplock worker`` processes over ``app``, the bench's tasks) and
``pgbench``. Figures are taken from the database (commit times, ``finished_at``) so that
polling by the bench itself does not blur them, and every scenario works in a schema of
its own, dropped afterwards. ``hosts`` and ``failover`` build their own servers on hosts
of a ``topology`` (root only).
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from skiplock.bench.measure import Report, Settings
from skiplock.bench.tasks import BENCH_SCHEMA, app
from skiplock.bench.workers import WORKER_ARGS
from skiplock.config import resolve_database_url

__all__ = ["OWN_SERVERS", "SCENARIOS", "app", "run"]

# Each scenario, in the order ``skiplock bench`` lists them, and the module running it.
SCENARIOS = {
    "enqueue": "enqueue",
    "drain": "drain",
    "ceiling": "ceiling",
    "latency": "wakeup",
    "seed": "seed",
    "history": "history",
    "scheduled": "history",
    "pressure": "pressure",
    "unique": "features",
    "ordered": "features",
    "keylimit": "features",
    "lowconc": "lowconc",
    "enqueue-concurrent": "enqueue_concurrent",
    "wakeup": "wakeup",
    "late-commit": "late_commit",
    "dashboard": "dashboard",
    "workflow": "workflow",
    "steps": "steps",
    "signals": "signals",
    "steps-chaos": "steps_chaos",
    "hosts": "hosts",
    "failover": "failover",
}
# Scenarios on servers the bench builds itself, on hosts of its own: --database-url unused.
OWN_SERVERS = ("hosts", "failover")


def _server(url: str) -> tuple[str, str]:
    """The server's version and fsync setting; with no URL (only scenarios that build
    their own servers), the version of the binaries they run."""
    if not url:
        from skiplock.bench.topology import postgres_version  # noqa: PLC0415

        return postgres_version(), "on"
    with psycopg.connect(url) as conn:
        settings = conn.execute(
            "SELECT current_setting('server_version'), current_setting('fsync')"
        ).fetchone()
    return settings or ("?", "?")


def run(
    scenarios: Sequence[str],
    *,
    database_url: str | None,
    jobs: int,
    processes: int,
    concurrency: int,
    runs: int,
    history_rows: int,
    as_json: bool,
    rate: int = 1000,
    phase_seconds: Sequence[float] = (20, 60, 180, 60),
    enqueue_seconds: float = 20.0,
    clients: Sequence[int] = (8, 32, 64),
    samples: int = 200,
    worker_args: Sequence[str] = (),
    promote_after: float = 0.0,
) -> int:
    """Run ``scenarios`` in turn and report their figures: a line each as they come, or
    one JSON object at the end (``as_json``)."""
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}")
    WORKER_ARGS[:] = worker_args
    # The others measure --database-url, or with nothing configured the embedded server
    # (as demo runs on it).
    own_servers = set(scenarios) <= set(OWN_SERVERS)
    url = "" if own_servers else resolve_database_url(database_url, fallback_embedded=True)
    version, fsync = _server(url)
    meta: dict[str, Any] = {
        "server_version": version,
        "fsync": fsync,
        "cpus": os.cpu_count(),
        "jobs": jobs,
        "processes": processes,
        "concurrency": concurrency,
    }
    if not as_json:
        print(
            f"skiplock bench: PostgreSQL {version}, fsync={fsync}, {meta['cpus']} CPUs; "
            f"{jobs:,} jobs, {processes} worker processes x {concurrency}; "
            f"median of {runs} runs",
            flush=True,
        )
    # Settings' fields are this function's options in its order (tests/test_bench_registry.py).
    settings = Settings(
        url, BENCH_SCHEMA, jobs, processes, concurrency, runs, history_rows, rate,
        phase_seconds, enqueue_seconds, clients, samples, promote_after,
    )  # fmt: skip
    report = Report(as_json)
    # A run that seems stuck can be asked where it is: `kill -USR1 PID` prints every
    # thread's stack to stderr and the run goes on (tests/test_smoke.py does so on a timeout).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    for number, name in enumerate(scenarios, 1):
        module = importlib.import_module(f"skiplock.bench.{SCENARIOS[name]}")
        started = time.monotonic()
        module.scenario(name, settings, report)
        if as_json:  # stdout holds only the JSON; say on stderr how far a long run is
            print(
                f"skiplock bench: {name} done in {time.monotonic() - started:.1f} s "
                f"({number} of {len(scenarios)})",
                file=sys.stderr,
                flush=True,
            )
    if as_json:
        print(report.json(meta))
    return 0
