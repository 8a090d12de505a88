"""What every scenario is given and how it reports: the settings of one ``skiplock bench``
invocation, a figure over several runs, the report that prints figures as they come (or
keeps them for one JSON object), percentiles, and CPU time per job read from /proc."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg


@dataclass(frozen=True)
class Settings:
    """One invocation's options (``skiplock bench --help``), the same for every scenario.
    ``url`` is empty when only scenarios that build their own servers run."""

    url: str
    schema: str
    jobs: int
    processes: int
    concurrency: int
    runs: int
    history_rows: int
    rate: int
    phase_seconds: Sequence[float]
    enqueue_seconds: float
    clients: Sequence[int]
    samples: int
    promote_after: float


@dataclass
class Figure:
    """One scenario's result over several runs."""

    name: str
    unit: str
    runs: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "unit": self.unit,
            "median": round(self.median, 3),
            "min": round(min(self.runs), 3),
            "max": round(max(self.runs), 3),
            "runs": [round(r, 3) for r in self.runs],
            **self.extra,
        }

    def line(self) -> str:
        text = (
            f"{self.name:<40} {self.median:>12,.1f} {self.unit:<8} "
            f"(min {min(self.runs):,.1f}, max {max(self.runs):,.1f}, runs {len(self.runs)})"
        )
        if self.extra:
            text += "  " + ", ".join(f"{k}={v}" for k, v in self.extra.items())
        return text


class Report:
    """The figures of one invocation: each printed as a line when it is reported, or all
    printed at the end as one JSON object (``--json``). The pressure scenario reports
    rows per phase instead of figures."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.figures: list[Figure] = []
        self.pressure: list[list[dict[str, Any]]] = []

    def figure(self, *figures: Figure) -> None:
        for figure in figures:
            self.figures.append(figure)
            if not self.as_json:
                print(figure.line(), flush=True)

    def pressure_run(self, rows: list[dict[str, Any]]) -> None:
        self.pressure.append(rows)
        if not self.as_json:
            for row in rows:
                print("pressure " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    def median(self, name: str) -> float | None:
        """The median of the figure called ``name`` reported so far, else None."""
        found = [f.median for f in self.figures if f.name == name]
        return found[-1] if found else None

    def json(self, meta: dict[str, Any]) -> str:
        return json.dumps(
            {
                "meta": meta,
                "figures": [f.as_dict() for f in self.figures],
                "pressure": self.pressure,
            }
        )


def percentile(values: Sequence[float], share: float) -> float:
    """The median for 0.5, else the nearest rank: the smallest value at or above
    ``share`` of them."""
    if share == 0.5:
        return statistics.median(values)
    ordered = sorted(values)
    rank = max(1, math.ceil(len(ordered) * share - 1e-9))  # 200 * 0.99 is rank 198
    return ordered[rank - 1]


@dataclass(frozen=True)
class Cpu:
    """CPU microseconds per job: the client processes' (Python), and the PostgreSQL
    backends' serving them; None where it could not be read (a server on another host)."""

    python_us: float | None
    postgres_us: float | None


def _proc_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU of a process (all its threads) from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used from now until ``per_job`` by some client processes and by the backends
    whose application_name matches ``backends`` (a LIKE pattern). Backends are read from
    /proc, so only for a server on this machine (``conn``'s own backend is there); new
    backends count from zero, and one that exits meanwhile is left out rather than
    voiding the measure."""

    def __init__(
        self, conn: psycopg.Connection[Any], clients: Sequence[int], backends: str
    ) -> None:
        self._conn = conn
        self._clients = list(clients)
        self._pattern = backends
        self._local = _proc_cpu_seconds(conn.info.backend_pid) is not None
        self._start_clients = self._client_seconds()
        self._start_backends = self._backend_seconds()

    def _client_seconds(self) -> float | None:
        total = 0.0
        for pid in self._clients:
            seconds = _proc_cpu_seconds(pid)
            if seconds is None:
                return None
            total += seconds
        return total

    def _backend_seconds(self) -> dict[int, float] | None:
        if not self._local:
            return None  # the server's processes are not this machine's
        rows = self._conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE %s",
            (self._pattern,),
        ).fetchall()
        found: dict[int, float] = {}
        for (pid,) in rows:
            seconds = _proc_cpu_seconds(pid)
            if seconds is not None:  # else it exited since pg_stat_activity was read
                found[pid] = seconds
        return found

    def per_job(self, jobs: int) -> Cpu:
        clients, backends = self._client_seconds(), self._backend_seconds()
        python_us = postgres_us = None
        if clients is not None and self._start_clients is not None:
            python_us = (clients - self._start_clients) * 1e6 / jobs
        if backends is not None and self._start_backends is not None:
            used = sum(s - self._start_backends.get(pid, 0.0) for pid, s in backends.items())
            postgres_us = used * 1e6 / jobs
        return Cpu(python_us, postgres_us)


def cpu_medians(samples: Sequence[Cpu]) -> dict[str, float | None]:
    """The median CPU per job over ``samples``, as figure extras."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 1) if known else None

    return {
        "py_cpu_us_per_job": median([c.python_us for c in samples]),
        "pg_cpu_us_per_job": median([c.postgres_us for c in samples]),
    }
