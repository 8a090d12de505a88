"""The ``hosts`` figure: drain rate of no-op jobs with workers on 1, 2 and 3 hosts (two
processes each) against the same server, every hop across the harness's bridge.

Only with ``SKIPLOCK_CLUSTER_BENCH=1`` (``scripts/cluster --bench``): it measures, it
asserts nothing about speed. On one machine the hosts share its cores, so the figure
shows what the network hop and more processes cost or gain here, not how a fleet of real
machines scales.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

# hostile.echo: a no-op sync task that records nothing.
from chaos.chaos_app import echo
from chaos.conftest import SCHEMA, ChaosDatabase, wait_until
from chaos.test_chaos import enqueue

from .conftest import JOBS, record_figures
from .harness import HOSTS, HostFleet

BENCH = os.environ.get("SKIPLOCK_CLUSTER_BENCH") == "1"
RUNS = int(os.environ.get("SKIPLOCK_CLUSTER_BENCH_RUNS", "3"))
PER_HOST = 2
CONCURRENCY = 16

pytestmark = pytest.mark.skipif(
    not BENCH,
    reason="a measurement: run it with SKIPLOCK_CLUSTER_BENCH=1 (scripts/cluster --bench)",
)


def left(db: ChaosDatabase) -> int:
    return int(db.scalar(f"SELECT count(*) FROM {SCHEMA}.jobs"))


@pytest.mark.timeout(600 + JOBS / 10)
@pytest.mark.parametrize("count", [1, 2, 3])
def test_drain_rate_with_workers_on_more_hosts(
    cluster_db: ChaosDatabase, hosts: HostFleet, count: int
) -> None:
    hosts.start_hosts(
        PER_HOST, cluster_db.conn, hosts=HOSTS[:count], concurrency=CONCURRENCY, queues="hostile"
    )
    rates = []
    for _ in range(RUNS):
        started = time.monotonic()
        enqueue(cluster_db, [echo.job() for _ in range(JOBS)])
        wait_until(
            lambda: left(cluster_db) == 0, 60 + JOBS / 20, 0.02, what="the drain", check=hosts.check
        )
        rates.append(JOBS / (time.monotonic() - started))
    record_figures(
        {
            "scenario": f"bench hosts={count}",
            "processes": PER_HOST * count,
            "concurrency": CONCURRENCY,
            "jobs": JOBS,
            "jobs_per_s_median": round(statistics.median(rates), 1),
            "jobs_per_s_runs": [round(r, 1) for r in rates],
        }
    )
