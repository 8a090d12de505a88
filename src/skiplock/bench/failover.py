"""The ``failover`` scenario (root only; it builds its own servers and hosts with
skiplock.bench.topology): a primary and its streaming standby (synchronous, then
asynchronous), workers on two hosts and an application enqueuing through one URL naming
both. Mid-drain the standby falls a second behind (its WAL sender stopped), then the
primary's host dies (every process SIGKILLed) and the standby is promoted. Figures:
seconds from the stop and from the promotion to the first completion on the new primary,
jobs lost (their enqueue's commit had returned), in-doubt enqueues (the connection broke
before the commit's answer), stale outcomes refused by the fence, and jobs completed
twice.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.bench.hosts import check_machine
from skiplock.bench.load import wait_drained
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.tasks import BENCH_SCHEMA, pause
from skiplock.bench.topology import STANDBY, Topology, poll_until
from skiplock.bench.workers import Placement, worker_processes

# The failover's workers: a completion the standby never received (asynchronous
# replication) leaves its job running under a worker that has forgotten it, until the
# lease runs out.
FAILOVER_WORKER_ARGS = ("--lease", "10", "--tcp-user-timeout", "4")
JOB_MS = 20
BATCH = 25
PATIENCE = 60.0
LAG = 1.0
POLL = 0.02
# What a worker logs when the fence refuses an outcome, or when it finds a lease lost and
# drops the outcome (completer.py, worker/leased.py).
REFUSED = re.compile(r"(?:refused stale outcome for|lost the lease of) job (\d+) attempt (\d+)")


class Enqueuer:
    """The application: ``jobs`` pause jobs at ``rate`` per second, ``BATCH`` per
    transaction, on a thread, through a URL naming both servers. It remembers the ids of
    every commit that returned, ids it was given twice (handed out by the old primary past
    what the standby had, then again by the new one), and how many jobs were in
    transactions whose end it could not know; those it does not enqueue again (they could
    run twice)."""

    def __init__(self, app: App, jobs: int, rate: float) -> None:
        self.app = app
        self.jobs = jobs
        self.rate = rate
        self.task = app.task(name="bench.pause")(pause.fn)
        self.committed: set[int] = set()
        self.reissued: set[int] = set()
        self.in_doubt = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="skiplock-bench-enqueuer")
        self.thread.daemon = True

    def _connect(self) -> psycopg.Connection[Any]:
        deadline = time.monotonic() + PATIENCE
        failures = 0
        while True:
            try:
                return self.app.connect(autocommit=True)
            except psycopg.OperationalError:
                failures += 1
                if time.monotonic() > deadline:
                    raise
                time.sleep(min(0.05 * 2**failures, 0.5))

    def _run(self) -> None:
        try:
            self._enqueue()
        except BaseException as exc:
            self.error = exc

    def _enqueue(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        next_at = time.monotonic()
        for start in range(0, self.jobs, BATCH):
            count = min(BATCH, self.jobs - start)
            try:
                if conn is None or conn.closed:
                    conn = self._connect()
                with conn.transaction():
                    ids = self.app.enqueue_many(
                        conn, [self.task.job(ms=JOB_MS) for _ in range(count)]
                    )
                self.reissued.update(i for i in ids if i in self.committed)
                self.committed.update(ids)
            except psycopg.OperationalError:
                self.in_doubt += count
                if conn is not None:
                    conn.close()
            next_at += count / self.rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        if conn is not None:
            conn.close()

    def finish(self) -> None:
        self.thread.join(PATIENCE + self.jobs / self.rate + 30)
        if self.thread.is_alive():
            raise RuntimeError("the bench's application did not finish enqueuing")
        if self.error is not None:
            raise RuntimeError(f"the bench's application failed: {self.error}") from self.error


def _scalar(conn: psycopg.Connection[Any], query: sql.SQL | sql.Composed, *params: Any) -> Any:
    row = conn.execute(query, params or None).fetchone()
    assert row is not None
    return row[0]


def _table(name: str) -> sql.Identifier:
    return sql.Identifier(BENCH_SCHEMA, name)


def _receiving(standby: psycopg.Connection[Any]) -> bool:
    return bool(_scalar(standby, sql.SQL("SELECT count(*) > 0 FROM pg_stat_wal_receiver")))


def _fall_behind(primary: psycopg.Connection[Any]) -> None:
    """The standby falls LAG seconds behind (the primary's WAL sender stopped), as under a
    loaded link: what asynchronous replication can then lose, and what synchronous
    replication makes the primary's committers wait for."""
    sender = primary.execute(
        "SELECT pid FROM pg_stat_replication WHERE application_name = %s", (STANDBY,)
    ).fetchone()
    if sender is None:
        raise RuntimeError("the standby is not streaming")
    os.kill(int(sender[0]), signal.SIGSTOP)
    time.sleep(LAG)  # the lag's length: the scenario's schedule, not a wait for an outcome


def refused_outcomes(logs: Sequence[Path]) -> int:
    """Distinct (job, attempt) outcomes the workers logged as refused or dropped."""
    seen: set[tuple[str, str]] = set()
    for path in logs:
        seen.update(REFUSED.findall(path.read_text(errors="replace")))
    return len(seen)


def failover_once(
    jobs: int,
    processes: int,
    concurrency: int,
    rate: float,
    *,
    synchronous: bool,
    promote_after: float = 0.0,
) -> dict[str, float]:
    """One failover, on a topology of its own (a failover uses it up). The standby is
    promoted ``promote_after`` seconds after it noticed the loss, as a failover manager
    does once its own timeouts have passed (Patroni's ttl is 30 s by default)."""
    topology = Topology(workers=2, standby=True, tag="bench")
    try:
        topology.up(lambda url: App(url, schema=BENCH_SCHEMA).migrate(), synchronous=synchronous)
        logs = topology.root / "logs"
        placement = Placement(topology.network, topology.worker_hosts, topology.url)
        primary = topology.primary.local_url()
        with worker_processes(
            primary,
            BENCH_SCHEMA,
            processes,
            concurrency,
            FAILOVER_WORKER_ARGS,
            placement=placement,
            logs=logs,
        ):
            enqueuer = Enqueuer(App(topology.local_url, schema=BENCH_SCHEMA), jobs, rate)
            enqueuer.thread.start()
            history = sql.SQL("SELECT count(*) FROM {}").format(_table("job_history"))
            with psycopg.connect(primary, autocommit=True) as old:
                poll_until(
                    lambda: _scalar(old, history) >= jobs // 4,
                    PATIENCE + jobs / rate,
                    POLL,
                    "a quarter of the jobs to complete",
                )
                _fall_behind(old)
            if not enqueuer.thread.is_alive():
                raise RuntimeError("the application finished enqueuing before the failover")
            stopped_at = datetime.now(UTC)
            topology.primary.power_off()
            with psycopg.connect(topology.standby.local_url(), autocommit=True) as new:
                poll_until(lambda: not _receiving(new), 30, POLL, "the standby to notice")
                time.sleep(promote_after)  # the manager's decision: the scenario's schedule
                promoted_at = topology.standby.promote()
                enqueuer.finish()
                wait_drained(new, BENCH_SCHEMA, timeout=120 + jobs / 50)
                return _failover_outcome(new, enqueuer, stopped_at, promoted_at, logs)
    finally:
        topology.down()


def _failover_outcome(
    new: psycopg.Connection[Any],
    enqueuer: Enqueuer,
    stopped_at: datetime,
    promoted_at: datetime,
    logs: Path,
) -> dict[str, float]:
    # Commit times are the server's own (track_commit_timestamp): after the stop only the
    # new primary commits.
    first = _scalar(
        new,
        sql.SQL(
            "SELECT min(pg_xact_commit_timestamp(xmin)) FROM {}"
            " WHERE pg_xact_commit_timestamp(xmin) > %s"
        ).format(_table("job_history")),
        stopped_at,
    )
    if first is None:
        raise RuntimeError("no job completed on the new primary")
    present = {
        int(r[0])
        for r in new.execute(
            sql.SQL("SELECT id FROM {} UNION ALL SELECT id FROM {}").format(
                _table("jobs"), _table("job_history")
            )
        ).fetchall()
    }
    twice = _scalar(
        new,
        sql.SQL(
            "SELECT count(*) FROM (SELECT id FROM {} GROUP BY id HAVING count(*) > 1) AS t"
        ).format(_table("job_history")),
    )
    lost = len(enqueuer.committed - present) + len(enqueuer.reissued)
    return {
        "stop_to_first_completion_s": (first - stopped_at).total_seconds(),
        "promotion_to_first_completion_s": (first - promoted_at).total_seconds(),
        "promotion_s": (promoted_at - stopped_at).total_seconds(),
        "jobs_lost": lost,
        "enqueues_in_doubt": enqueuer.in_doubt,
        "stale_outcomes_refused": refused_outcomes(sorted(logs.glob("*.log"))),
        "completed_twice": int(twice),
    }


FAILOVER_FIGURES = (
    ("stop_to_first_completion_s", "s", "stop to 1st completion"),
    ("promotion_to_first_completion_s", "s", "promotion to 1st completion"),
    ("jobs_lost", "jobs", "jobs lost"),
    ("enqueues_in_doubt", "jobs", "enqueues in doubt"),
    ("stale_outcomes_refused", "outcomes", "stale outcomes refused"),
    ("completed_twice", "jobs", "completed twice"),
)


def failover_figures(
    jobs: int, processes: int, concurrency: int, runs: int, rate: float, promote_after: float
) -> list[Figure]:
    """The ``failover`` scenario: ``runs`` failovers with synchronous replication, then as
    many with asynchronous; a figure per measure and mode."""
    check_machine("failover", standby=True)
    figures = []
    for synchronous in (True, False):
        mode = "sync" if synchronous else "async"
        results = [
            failover_once(
                jobs,
                processes,
                concurrency,
                rate,
                synchronous=synchronous,
                promote_after=promote_after,
            )
            for _ in range(runs)
        ]
        for key, unit, what in FAILOVER_FIGURES:
            runs_of = [float(r[key]) for r in results]
            figures.append(Figure(f"failover {mode}: {what}", unit, runs_of))
    return figures


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    figures = failover_figures(s.jobs, s.processes, s.concurrency, s.runs, s.rate, s.promote_after)
    report.figure(*figures)
