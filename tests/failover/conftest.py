"""Fixtures for the failover tests: a primary and its streaming standby on hosts of a
``skiplock.bench.topology.Topology``, with two worker hosts, built afresh for each test (a
failover uses them up).

The size is ``SKIPLOCK_FAILOVER_JOBS`` (default 1,000 jobs per scenario, the CI size;
20,000 is the full size). The tests skip, saying why, where they cannot build
hosts (not root, no ``ip netns``, no PostgreSQL 15 binaries). Figures are printed at the
end of the run and, when ``SKIPLOCK_FAILOVER_REPORT`` names a file, appended to it as JSON
lines.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import skiplock
from chaos.conftest import SCHEMA, ChaosDatabase
from cluster.harness import HostFleet
from figures import FigureLog
from skiplock.bench.topology import Topology, remove_leftovers, unavailable

JOBS = int(os.environ.get("SKIPLOCK_FAILOVER_JOBS", "1000"))
WORKER_HOSTS = ("h1", "h2")
REPORT_ENV = "SKIPLOCK_FAILOVER_REPORT"


def prepare_database(local_url: str) -> None:
    """skiplock's schema and the chaos suite's execution record, made on the primary
    before the standby is copied from it."""
    skiplock.App(local_url, schema=SCHEMA).migrate()
    with psycopg.connect(local_url, autocommit=True) as conn:
        ChaosDatabase(local_url, conn).reset()


@pytest.fixture
def build_cluster() -> Iterator[Callable[[bool], Topology]]:
    """Builds a primary and a standby, synchronous or not; removed after the test, also
    when it failed or the setup broke half-way."""
    reason = unavailable(standby=True)
    if reason is not None:
        pytest.skip(reason)
    remove_leftovers()
    built: list[Topology] = []

    def build(synchronous: bool) -> Topology:
        # Its own run name, so that a pytest run with the cluster tests never reuses
        # their namespaces.
        cluster = Topology(workers=len(WORKER_HOSTS), standby=True, tag="fo")
        built.append(cluster)
        cluster.up(prepare_database, synchronous=synchronous)
        return cluster

    try:
        yield build
    finally:
        for cluster in built:
            cluster.down()


@pytest.fixture
def fleet_on(tmp_path: Path) -> Iterator[Callable[[Topology], HostFleet]]:
    """Worker fleets on a cluster's URL, which names both servers; every process is killed
    at teardown."""
    fleets: list[HostFleet] = []

    def make(cluster: Topology) -> HostFleet:
        fleets.append(HostFleet(cluster, tmp_path))
        return fleets[-1]

    try:
        yield make
    finally:
        for fleet in fleets:
            fleet.close()


FIGURE_LOG = FigureLog("failover figures", REPORT_ENV)
record_figures = FIGURE_LOG.record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    FIGURE_LOG.summary(terminalreporter)
