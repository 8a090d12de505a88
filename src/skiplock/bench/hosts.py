"""The ``hosts`` scenario (root only; it builds its own hosts and server with
skiplock.bench.topology): the drain rate of no-op jobs with workers on 1, 2 and 3 hosts
(``--processes`` each) against one server, every hop across the topology's bridge. On
one machine the hosts share its cores: the figure shows what the hop and more processes
cost or gain here, not how a fleet of real machines scales."""

from __future__ import annotations

from skiplock.bench.drain import drain
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.tasks import BENCH_SCHEMA
from skiplock.bench.topology import Topology, remove_leftovers, unavailable
from skiplock.bench.workers import Placement
from skiplock.errors import ConfigurationError

HOST_COUNTS = (1, 2, 3)


def check_machine(scenario: str, *, standby: bool = False) -> None:
    """Refuse, naming what is missing, on a machine that cannot build a topology; then
    remove what runs killed before their clean-up left behind."""
    reason = unavailable(standby=standby)
    if reason is not None:
        raise ConfigurationError(f"bench --scenarios {scenario}: {reason}")
    remove_leftovers()


def hosts_figures(jobs: int, processes: int, concurrency: int, runs: int) -> list[Figure]:
    """The ``hosts`` scenario: one figure per number of hosts, with its ratio to one."""
    check_machine("hosts")
    topology = Topology(workers=max(HOST_COUNTS), tag="bench")
    figures: list[Figure] = []
    try:
        topology.up()
        url = topology.primary.local_url()
        for count in HOST_COUNTS:
            placement = Placement(
                topology.network, topology.worker_hosts[:count], topology.primary.url
            )
            fig = Figure(f"hosts: workers on {count}", "jobs/s")
            fig.extra["processes"] = processes * count
            fig.runs = [
                drain(url, BENCH_SCHEMA, jobs, processes, concurrency, placement=placement).rate
                for _ in range(runs)
            ]
            if figures:
                fig.extra["vs_one_host"] = round(fig.median / figures[0].median, 2)
            figures.append(fig)
    finally:
        topology.down()
    return figures


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    report.figure(*hosts_figures(s.jobs, s.processes, s.concurrency, s.runs))
