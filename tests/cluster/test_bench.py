"""``skiplock bench --scenarios hosts,failover``: the scenarios that build hosts and servers
of their own (skiplock/bench/hosts.py), run as the command a user types, at a small size.

They measure; what is asserted is what must hold whatever the machine's speed: every
figure is there, each drain rate is positive, and with synchronous replication no job
whose enqueue returned is lost and none is completed twice (asynchronous replication may
lose some: docs/failover.md).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from skiplock.bench.failover import FAILOVER_FIGURES
from skiplock.bench.hosts import HOST_COUNTS
from skiplock.bench.topology import unavailable

from .conftest import record_figures


@pytest.fixture(autouse=True)
def _hosts_can_be_built() -> None:
    reason = unavailable(standby=True)
    if reason is not None:
        pytest.skip(reason)


def bench(*scenario_args: str, timeout: float) -> dict[str, dict[str, Any]]:
    command = [sys.executable, "-m", "skiplock", "bench", "--json", "--runs", "1"]
    done = subprocess.run(
        [*command, *scenario_args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    return {figure["name"]: figure for figure in report["figures"]}


@pytest.mark.timeout(300)
def test_the_hosts_scenario_drains_with_workers_on_one_two_and_three_hosts() -> None:
    figures = bench(
        *("--scenarios", "hosts", "--jobs", "600", "--processes", "1", "--concurrency", "8"),
        timeout=280,
    )
    assert sorted(figures) == sorted(f"hosts: workers on {n}" for n in HOST_COUNTS)
    for count in HOST_COUNTS:
        figure = figures[f"hosts: workers on {count}"]
        assert figure["unit"] == "jobs/s" and figure["processes"] == count, figure
        assert isinstance(figure["median"], float) and figure["median"] > 0, figure
    record_figures({"scenario": "bench hosts", **{k: v["median"] for k, v in figures.items()}})


@pytest.mark.timeout(420)
def test_the_failover_scenario_loses_nothing_with_synchronous_replication() -> None:
    figures = bench(
        *("--scenarios", "failover", "--jobs", "800", "--rate", "200", "--promote-after", "1"),
        *("--processes", "1", "--concurrency", "8"),
        timeout=400,
    )
    names = [
        f"failover {mode}: {what}" for mode in ("sync", "async") for _, _, what in FAILOVER_FIGURES
    ]
    assert sorted(figures) == sorted(names)
    for name, figure in figures.items():
        median = figure["median"]
        assert isinstance(median, float) and math.isfinite(median), figure
        # The promotion is seen by polling every 5 ms: a completion may just precede it.
        if "promotion" not in name:
            assert median >= 0, figure
    for mode in ("sync", "async"):
        # The promotion waited a second after the standby noticed the loss.
        assert figures[f"failover {mode}: stop to 1st completion"]["median"] > 1
    assert figures["failover sync: jobs lost"]["median"] == 0
    assert figures["failover sync: completed twice"]["median"] == 0
    assert figures["failover async: completed twice"]["median"] == 0
    record_figures({"scenario": "bench failover", **{k: v["median"] for k, v in figures.items()}})
