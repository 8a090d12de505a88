"""Fixtures for the failover tests: a primary and its standby on hosts of the cluster
harness (replication.py), built afresh for each test (a failover uses them up).

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
from cluster.harness import DATABASE, remove_leftovers
from figures import FigureLog

from .replication import FailoverCluster, FailoverFleet, failover_unavailable

JOBS = int(os.environ.get("SKIPLOCK_FAILOVER_JOBS", "1000"))
REPORT_ENV = "SKIPLOCK_FAILOVER_REPORT"


def prepare_database(local_url: str) -> None:
    """The database, skiplock's schema and the chaos suite's execution record, made on the
    primary before the standby is copied from it."""
    admin_url = local_url.replace(f"dbname={DATABASE}", "dbname=postgres")
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {DATABASE}")
    skiplock.App(local_url, schema=SCHEMA).migrate()
    with psycopg.connect(local_url, autocommit=True) as conn:
        ChaosDatabase(local_url, conn).reset()


@pytest.fixture
def build_cluster() -> Iterator[Callable[[bool], FailoverCluster]]:
    """Builds a primary and a standby, synchronous or not; removed after the test, also
    when it failed or the setup broke half-way."""
    reason = failover_unavailable()
    if reason is not None:
        pytest.skip(reason)
    remove_leftovers()
    built: list[FailoverCluster] = []

    def build(synchronous: bool) -> FailoverCluster:
        cluster = FailoverCluster(prepare_database, synchronous=synchronous)
        built.append(cluster)
        cluster.up()
        return cluster

    try:
        yield build
    finally:
        for cluster in built:
            cluster.down()


@pytest.fixture
def fleet_on(tmp_path: Path) -> Iterator[Callable[[FailoverCluster], FailoverFleet]]:
    """Worker fleets on a cluster's URL; every process is killed at teardown."""
    fleets: list[FailoverFleet] = []

    def make(cluster: FailoverCluster) -> FailoverFleet:
        fleets.append(FailoverFleet(cluster, tmp_path))
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
