"""``skiplock demo`` and every ``skiplock bench`` scenario, run as real subprocesses at a
tiny size, so that neither can break unseen (the ceiling scenario once did).

Each is given a URL carrying a password, through the environment only. The server ignores
it (trust authentication), and a watcher reads /proc/PID/cmdline of every process they
start while they run: the password must never appear on a command line, where any user of
the machine can read it.

Cost per server, measured on 2 shared cores: the demo about 2 s, bench about 100 s (the
``wakeup`` scenario's 200 probes 20 ms apart for each of five insert paths and the
``latency`` scenario's 200 more, enqueue-concurrent's 24 runs of 1 s, four 1 s pressure
phases, the ``seed`` scenario's two demo runs, and a start of worker processes per drain).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock.bench import OWN_SERVERS
from skiplock.bench import dashboard as dashboard_bench
from skiplock.bench.enqueue_concurrent import COMMIT_PATHS
from skiplock.bench.pgbench import pgbench_path
from skiplock.bench.tasks import BENCH_SCHEMA
from skiplock.bench.wakeup import wakeup_paths
from skiplock.cli.bench import SCENARIOS

PASSWORD = "secret-7f3a"


def with_password(url: str) -> str:
    """``url`` with a password the server will not check (trust auth)."""
    params = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    params["password"] = PASSWORD
    return make_conninfo("", **params)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now (from /proc/PID/stat)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        found[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return found


class CommandLines:
    """Every descendant of one process and its command line, sampled until stopped."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            parents = _parents()
            family = {self.root}
            grew = True
            while grew:
                more = {pid for pid, ppid in parents.items() if ppid in family} - family
                family |= more
                grew = bool(more)
            for pid in family - {self.root}:
                try:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if raw:  # empty while a child is between fork and exec
                    self.seen[pid] = raw.replace(b"\0", b" ").decode("utf-8", "replace")
            self._stop.wait(0.01)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def holding(self, text: str) -> list[str]:
        return [line for line in self.seen.values() if text in line]


@contextmanager
def watched(command: list[str], url: str) -> Iterator[tuple[subprocess.Popen[str], CommandLines]]:
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_SCHEMA"}
    env["SKIPLOCK_DATABASE_URL"] = url
    with subprocess.Popen(
        [sys.executable, "-m", "skiplock", *command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its group: a kill reaches the worker processes it started
    ) as proc:
        lines = CommandLines(proc.pid)
        lines.start()
        try:
            yield proc, lines
        finally:
            lines.stop()
            if proc.poll() is None:
                kill_group(proc)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process and whatever it started (its session's group), if any is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def database_state(url: str) -> str:
    """The bench schema's jobs by state (with a last error of each) and every other
    session of the database that is not idle: for the message of a run that hung."""
    lines = []
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
            conn.execute("SET statement_timeout = '10s'")
            found = conn.execute("SELECT to_regclass(%s)", (f"{BENCH_SCHEMA}.jobs",)).fetchone()
            if found is not None and found[0] is not None:
                jobs = sql.SQL(
                    "SELECT state, count(*), max(attempts), max(left((errors -> -1)::text, 300)) "
                    "FROM {} GROUP BY state"
                ).format(sql.Identifier(BENCH_SCHEMA, "jobs"))
                lines += [f"jobs {row}" for row in conn.execute(jobs)]
            sessions = conn.execute(
                "SELECT pid, application_name, state, wait_event_type, wait_event, "
                "now() - xact_start, left(query, 200) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND state IS DISTINCT FROM 'idle'"
            )
            lines += [f"session {row}" for row in sessions]
    except psycopg.Error as exc:
        lines.append(f"(could not read the database: {exc})")
    return "\n".join(lines) or "(no jobs table, no busy session)"


def run_watched(
    command: list[str], url: str, timeout: float
) -> tuple[dict[str, Any], CommandLines]:
    with watched(command, url) as (proc, lines):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Where it hangs: its threads' stacks (bench prints them on SIGUSR1) and what
            # the database holds and does for it.
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            seen = database_state(url)
            kill_group(proc)
            _, err = proc.communicate()
            pytest.fail(
                f"{command[:1]} still running after {timeout} s; the database:\n{seen}\n"
                f"it said:\n{err[-6000:]}"
            )
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return json.loads(out), lines


def finite_positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.timeout(180)
def test_demo_json_holds_every_check_and_keeps_the_password_off_command_lines(
    database_url: str,
) -> None:
    report, lines = run_watched(
        ["demo", "--json", "--demo-schema", "smoke_demo"], with_password(database_url), 150
    )

    assert report["ok"] is True, report
    assert all(report["checks"].values()), report["checks"]
    assert report["server"]["embedded"] is False
    assert (report["jobs"], report["completed"], report["dead"]) == (400, 399, 1)
    assert [job["n"] for job in report["dead_jobs"]] == [7]
    assert finite_positive(report["drain_seconds"])
    assert report["crash_recovered"] is True
    # The crash half ran a worker process of its own, and it was watched.
    assert lines.holding("skiplock.demo:crash_app"), lines.seen
    assert lines.holding(PASSWORD) == []


# Figure names per scenario, as `bench --json` reports them, for the tiny run below: one
# client count, a few wake-ups per insert path.
SMOKE_CLIENTS = (8,)
SMOKE_SAMPLES = 20
COMMIT_NAMES = [
    f"enqueue-concurrent {path}, {clients} clients{worker}{reference}"
    for worker in ("", ", idle worker")
    for path in COMMIT_PATHS
    for clients in SMOKE_CLIENTS
    for reference in ("", ", no trigger")
]
EXPECTED_FIGURES = {
    "enqueue": ["enqueue (enqueue_many)"],
    "drain": ["drain"],
    "ceiling": [
        "ceiling (SQL only)",
        *(["ceiling (raw SQL, pgbench)"] if pgbench_path() is not None else []),
        "ceiling: drain 2x10",
    ],
    "latency": ["latency p50", "latency p95", "latency p99"],
    "seed": ["seed (lesson's 400 jobs)", "seed, prefetch 0"],
    "history": ["drain, 500 finished rows"],
    "scheduled": ["drain, 500 scheduled rows"],
    "unique": ["drain, unique jobs"],
    "ordered": ["drain, ordered jobs"],
    "keylimit": ["drain, keylimit jobs"],
    "lowconc": [
        "lowconc reference (lesson, batch UPDATE)",
        "lowconc reference (lesson, per-job UPDATE)",
        "lowconc 1x1",
        "lowconc 1x4",
        "lowconc 1x10",
    ],
    "enqueue-concurrent": COMMIT_NAMES,
    "wakeup": [f"wake-up {path} {pct}" for path in wakeup_paths() for pct in ("p50", "p95", "p99")],
    "late-commit": [
        f"late-commit{variant} {pct}"
        for variant in ("", ", higher priority")
        for pct in ("p50", "p99")
    ],
    "dashboard": [
        f"dashboard {name}" for name, _ in dashboard_bench.pages(history_rows=500, live_jobs=300)
    ],
    "workflow": [
        "workflow enqueue, 300 steps in one call",
        "workflow hop, a chain of 300",
        "drain, 300 plain jobs",
        "drain, 300 steps as fan-out/fan-in workflows",
        "drain, 300 steps as one fan-in",
    ],
    "steps": [
        "steps: 30 plain jobs",
        "steps: 30 jobs of 10 steps, async handlers",
        "steps: 30 jobs of 10 steps, sync handlers",
    ],
    "signals": [
        "signals: 300 waits, signal commit to resume p50",
        "signals: drain of 300 plain jobs",
        "signals: the same beside 3,000 waiting and sleeping",
    ],
    "steps-chaos": ["steps-chaos: 300 jobs of 3 steps, a SIGKILL a second"],
}
PHASES = ["warm-up", "clean", "held", "recovery"]


@pytest.mark.second_server  # a minute and more, whatever the server
@pytest.mark.timeout(480)
def test_every_bench_scenario_runs_at_a_tiny_size(database_url: str) -> None:
    # A new one is listed here. Those building servers of their own need root and run in
    # tests/cluster/test_bench.py.
    assert set(EXPECTED_FIGURES) | {"pressure", *OWN_SERVERS} == set(SCENARIOS)
    command = [
        "bench",
        "--json",
        "--scenarios",
        ",".join(s for s in SCENARIOS if s not in OWN_SERVERS),
        "--jobs",
        "300",
        "--runs",
        "1",
        "--processes",
        "2",
        "--concurrency",
        "10",
        "--history-rows",
        "500",
        "--rate",
        "200",
        "--phases",
        "1,1,1,1",
        "--enqueue-seconds",
        "1",
        "--clients",
        ",".join(map(str, SMOKE_CLIENTS)),
        "--samples",
        str(SMOKE_SAMPLES),
    ]

    report, lines = run_watched(command, with_password(database_url), 420)

    assert report["meta"]["jobs"] == 300
    assert report["meta"]["processes"] == 2
    figures = {figure["name"]: figure for figure in report["figures"]}
    assert sorted(figures) == sorted(n for names in EXPECTED_FIGURES.values() for n in names)
    for figure in figures.values():
        assert figure["runs"] == [figure["median"]], figure
        if figure["unit"] == "repeated effects":
            # A count, which a tiny run's kills may leave at zero; nothing may be lost,
            # and every repeat must be a step that ran in a killed process.
            assert figure["median"] >= 0, figure
            assert (figure["not_by_a_kill"], figure["steps_lost"], figure["jobs_lost"]) == (
                0,
                0,
                0,
            ), figure
        elif figure["unit"] == "ms" and "dashboard" not in figure["name"]:
            # From the committing client's clock after its commit returned: the worker may
            # start the job a little before that, so a wake-up may read just below zero.
            assert math.isfinite(figure["median"]), figure
        else:
            assert finite_positive(figure["median"]), figure
    # Throughput figures are jobs/s; the drain took some time, so none is absurd.
    for name in ("drain", "ceiling (SQL only)", "enqueue (enqueue_many)"):
        assert figures[name]["unit"] == "jobs/s"
    # The worker's largest claim: batch_max, short jobs being claimed ahead (decision 018).
    assert figures["ceiling (SQL only)"]["batch"] == 100
    # The drain at --processes x --concurrency, set against the ceiling of the same run.
    assert finite_positive(figures["ceiling: drain 2x10"]["vs_ceiling"])
    for prefix in ("latency", *(f"wake-up {path}" for path in wakeup_paths())):
        p50, p95, p99 = (figures[f"{prefix} {pct}"]["median"] for pct in ("p50", "p95", "p99"))
        assert p50 <= p95 <= p99, prefix
        assert figures[f"{prefix} p50"]["samples"] == SMOKE_SAMPLES
    # The low-concurrency drains are set against both lesson references, with CPU per job
    # read from /proc (the server is on this machine; at this size a drain may take less
    # than the clock tick CPU time is counted in, hence >= 0).
    for name in EXPECTED_FIGURES["lowconc"]:
        figure = figures[name]
        assert figure["jobs"] == 300
        for cpu in ("py_cpu_us_per_job", "pg_cpu_us_per_job"):
            assert isinstance(figure[cpu], float) and figure[cpu] >= 0, figure
        if "reference" not in name:
            assert finite_positive(figure["vs_reference"]), figure
            assert finite_positive(figure["vs_reference_per_job"]), figure
    # Each insert path and client count against the trigger-less reference; plain SQL
    # under pgbench when there is one; no worker, then one idle worker on each schema.
    for name in COMMIT_NAMES:
        figure = figures[name]
        assert figure["unit"] == "tx/s"
        assert (figure["workers"] == "none") == ("idle worker" not in name), figure
        if "SQL INSERT" in name and pgbench_path() is not None:
            assert figure["client"].startswith("pgbench"), figure
        if not name.endswith("no trigger"):
            assert finite_positive(figure["vs_no_trigger"]), figure
    # Late jobs: at least a few per variant, and the worker's claims had passed them.
    for name in EXPECTED_FIGURES["late-commit"]:
        figure = figures[name]
        assert figure["samples"] >= 5 and 0 <= figure["passed"] <= 1, figure
    [pressure] = report["pressure"]
    assert [row["phase"] for row in pressure] == PHASES
    for row in pressure:
        assert row["throughput"] > 0, row
        assert row["latency_p50_ms"] is not None, row
    # Worker processes, the ceiling's clients and the seed's demo all ran, and were watched.
    assert lines.holding("skiplock.bench:app"), lines.seen
    assert lines.holding("multiprocessing"), lines.seen
    assert lines.holding(" demo "), lines.seen
    if pgbench_path() is not None:
        assert lines.holding("pgbench"), lines.seen
    assert lines.holding(PASSWORD) == []
