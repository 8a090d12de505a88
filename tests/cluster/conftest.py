"""Fixtures for the cluster tests: hosts as network namespaces (skiplock.bench.topology), a
server of the module's own, worker fleets per test, and the figures they measure.

The size is ``SKIPLOCK_CLUSTER_JOBS`` (default 1,500 jobs per scenario) and the outage
``SKIPLOCK_CLUSTER_OUTAGE`` seconds (default 8: past the server's dead-peer detection and
the short lease of the freeze scenario); ``scripts/cluster`` runs 100,000 jobs and 30 s.
The tests skip, saying why, where they cannot build hosts (not root, no ``ip netns``, no
PostgreSQL 15 binaries). Figures are printed at the end of the run and, when
``SKIPLOCK_CLUSTER_REPORT`` names a file, appended to it as JSON lines.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import skiplock
from chaos.conftest import SCHEMA, ChaosDatabase
from figures import FigureLog
from skiplock.bench.topology import Topology, remove_leftovers, unavailable

from .harness import HostFleet

JOBS = int(os.environ.get("SKIPLOCK_CLUSTER_JOBS", "1500"))
OUTAGE = float(os.environ.get("SKIPLOCK_CLUSTER_OUTAGE", "8"))
REPORT_ENV = "SKIPLOCK_CLUSTER_REPORT"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Topology]:
    """Namespaces, bridge and a migrated server for the module; removed after it, also
    when a test failed or the setup broke half-way."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    remove_leftovers()
    built = Topology(workers=3)
    try:
        built.up(lambda url: skiplock.App(url, schema=SCHEMA).migrate())
        yield built
    finally:
        built.down()


@pytest.fixture
def cluster_db(cluster: Topology) -> Iterator[ChaosDatabase]:
    """The cluster's database with empty queue tables and execution record, and the
    test's connection to it (through the server's socket, from the root namespace)."""
    url = cluster.primary.local_url()
    db = ChaosDatabase(url, psycopg.connect(url, autocommit=True))
    db.reset()
    yield db
    db.close()


@pytest.fixture
def hosts(cluster: Topology, cluster_db: ChaosDatabase, tmp_path: Path) -> Iterator[HostFleet]:
    """Workers on the cluster's hosts; every link is restored and every process killed
    (stopped ones too) at teardown."""
    fleet = HostFleet(cluster, tmp_path)
    try:
        yield fleet
    finally:
        try:
            cluster.network.restore_all()
        finally:
            fleet.close()


FIGURE_LOG = FigureLog("cluster figures", REPORT_ENV)
record_figures = FIGURE_LOG.record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    FIGURE_LOG.summary(terminalreporter)
