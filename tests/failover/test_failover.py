"""Failover to a streaming standby, mid-drain (replication.py builds the servers).

Workers on two hosts and an enqueuing application on one of them connect with one URL
naming the primary and its standby (``target_session_attrs=read-write``). While the jobs
drain and the application still enqueues, the primary is stopped hard (``pg_ctl stop -m
immediate``) and the standby promoted at once, as a failover manager would once it has
decided. The chaos suite's judge then reads the new primary: every job ran to its
designed end exactly once, no stale outcome was accepted, and every re-run is explained
by the failover (the workers' sessions, liveness locks and uncommitted claims were on the
old primary).

Synchronous replication: every job whose enqueue commit returned is there (0 lost).
Asynchronous: the jobs lost are exactly what the standby had not received: the enqueue's
commit position is past the standby's last received WAL position at the promotion.

Figures: seconds from the promotion (and from the crash) to the first completion on the
new primary, jobs lost, in-doubt enqueues, re-runs by reason.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from chaos.conftest import ROOT, SCHEMA, ChaosDatabase, utcnow
from chaos.test_chaos import LOST_CLAIM, drain, explain_lost_claims, judge
from cluster.harness import HostFleet
from conftest import wait_until
from skiplock.bench.topology import STANDBY, Topology

from .conftest import JOBS, WORKER_HOSTS, record_figures

PER_HOST = 1
CONCURRENCY = 8
# A completion the standby never received leaves its job running on the new primary under
# a worker that is alive and holds its liveness lock there, but has forgotten the job: only
# the lease's end gives it back (asynchronous replication; docs/failover.md).
LEASE = 10.0
POLL = 0.05
BATCH = 25
# The application enqueues for about as long as the drain takes, so that it is still
# committing when the primary goes.
ENQUEUE_SECONDS = max(4.0, JOBS / 250)
DRAIN_DEADLINE = 90.0 + JOBS / 40
TIMEOUT = 180.0 + JOBS / 20
ENQUEUER_PATIENCE = 60.0
# Seconds the standby falls behind before the primary dies: what asynchronous replication
# can lose, and what synchronous replication makes the primary's committers wait for.
LAG = 1.0
# Every worker lost its sessions (and its liveness lock) with the old primary.
ACTED_ON = {"WorkerLost", "LeaseExpired", "Reconciled"}


@pytest.fixture
def seed() -> int:
    return random.randrange(2**32)


def lsn(text: str) -> int:
    """A WAL position ("16/B374D848") as a number, to compare two of them."""
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def test_wal_positions_compare_as_numbers() -> None:
    assert lsn("0/3000148") < lsn("0/30001F0") < lsn("1/0")
    assert lsn("16/B374D848") == (0x16 << 32) + 0xB374D848


@dataclass
class Enqueued:
    """What the application was told: the ids of every commit that returned, with the
    WAL position read after it (None when the server went first), the ids issued twice
    (an id handed out by the old primary that the new one handed out again), and how many
    jobs were in transactions whose outcome it could not know."""

    committed: dict[int, int | None] = field(default_factory=dict)
    reissued: dict[int, int | None] = field(default_factory=dict)
    in_doubt: int = 0
    errors: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Enqueued:
        enqueued = cls()
        for text in path.read_text().splitlines():
            line = json.loads(text)
            if "ids" not in line:
                enqueued.in_doubt += int(line["in_doubt"])
                enqueued.errors.append(str(line["error"]))
                continue
            position = None if line["lsn"] is None else lsn(line["lsn"])
            for job_id in line["ids"]:
                if job_id in enqueued.committed:
                    enqueued.reissued[job_id] = enqueued.committed[job_id]
                enqueued.committed[job_id] = position
        return enqueued


def start_enqueuer(cluster: Topology, out: Path, seed: int) -> subprocess.Popen[bytes]:
    interval = ENQUEUE_SECONDS / max(1, JOBS // BATCH)
    command = cluster.network.run_in(
        WORKER_HOSTS[0],
        [
            sys.executable,
            "-m",
            "failover.enqueuer",
            "--url",
            cluster.url,
            "--jobs",
            str(JOBS),
            "--batch",
            str(BATCH),
            "--interval",
            f"{interval:.4f}",
            "--seed",
            str(seed),
            "--patience",
            str(ENQUEUER_PATIENCE),
            "--out",
            str(out),
        ],
    )
    with (out.parent / "enqueuer.log").open("wb") as log:
        return subprocess.Popen(command, cwd=ROOT / "tests", stdout=log, stderr=subprocess.STDOUT)


def completions(db: ChaosDatabase) -> int:
    return int(db.scalar(f"SELECT count(*) FROM {SCHEMA}.job_history"))


def present(db: ChaosDatabase) -> set[int]:
    rows = db.conn.execute(
        f"SELECT id FROM {SCHEMA}.jobs UNION ALL SELECT id FROM {SCHEMA}.job_history"
    ).fetchall()
    return {int(r[0]) for r in rows}


@dataclass
class Failover:
    crashed_at: datetime
    promoted_at: datetime
    received: int  # the standby's last received WAL position when the primary was gone


def walsender_pid(cluster: Topology) -> int:
    with psycopg.connect(cluster.primary.local_url(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_replication WHERE application_name = %s", (STANDBY,)
        ).fetchone()
    assert row is not None, "the standby is not streaming"
    return int(row[0])


def receiving(standby: psycopg.Connection[Any]) -> bool:
    row = standby.execute("SELECT count(*) FROM pg_stat_wal_receiver").fetchone()
    return row is not None and int(row[0]) > 0


def fail_over(cluster: Topology, fleet: HostFleet) -> Failover:
    """The standby falls behind (the primary's WAL sender is stopped for LAG seconds),
    then the primary's host dies (every process SIGKILLed), then the standby is promoted
    as soon as it has noticed."""
    sender = walsender_pid(cluster)
    os.kill(sender, signal.SIGSTOP)
    time.sleep(LAG)  # the lag's length: the chaos's schedule, not a wait for an outcome
    for worker in fleet.workers:
        fleet.record("cut", worker.pid, "primary lost")
    crashed_at = utcnow()
    cluster.primary.power_off()
    with psycopg.connect(cluster.standby.local_url(), autocommit=True) as standby:
        wait_until(
            lambda: not receiving(standby), 30, interval=POLL, what="the standby to notice the loss"
        )
        row = standby.execute("SELECT pg_last_wal_receive_lsn()::text").fetchone()
    assert row is not None and row[0] is not None
    promoted_at = cluster.standby.promote()
    return Failover(crashed_at, promoted_at, lsn(row[0]))


def first_completion_after(db: ChaosDatabase, moment: datetime) -> datetime:
    """The first commit of a completion after ``moment`` (commit times are the server's,
    track_commit_timestamp): after the crash only the new primary commits."""
    first = db.scalar(
        f"SELECT min(pg_xact_commit_timestamp(xmin)) FROM {SCHEMA}.job_history"
        " WHERE pg_xact_commit_timestamp(xmin) > %s",
        (moment,),
    )
    assert first is not None, "no job completed on the new primary"
    return first  # type: ignore[no-any-return]


def run_failover(
    cluster: Topology, fleet: HostFleet, out: Path, seed: int
) -> tuple[ChaosDatabase, Failover, Enqueued]:
    with psycopg.connect(cluster.primary.local_url(), autocommit=True) as conn:
        old = ChaosDatabase(cluster.primary.local_url(), conn)
        started = [
            fleet.start_on(host, concurrency=CONCURRENCY, lease=LEASE)
            for host in WORKER_HOSTS
            for _ in range(PER_HOST)
        ]
        fleet.wait_registered(conn, started)
        enqueuer = start_enqueuer(cluster, out, seed)
        try:
            wait_until(
                lambda: completions(old) >= JOBS // 4,
                DRAIN_DEADLINE,
                interval=POLL,
                what="a quarter of the jobs to complete",
                check=fleet.check,
            )
            assert enqueuer.poll() is None, "the application finished enqueuing before the crash"
            failover = fail_over(cluster, fleet)
        except BaseException:
            enqueuer.kill()
            raise
    url = cluster.standby.local_url()
    db = ChaosDatabase(url, psycopg.connect(url, autocommit=True))
    try:
        code = enqueuer.wait(timeout=ENQUEUER_PATIENCE + ENQUEUE_SECONDS + 30)
    except subprocess.TimeoutExpired:
        enqueuer.kill()
        raise
    assert code == 0, (out.parent / "enqueuer.log").read_text()[-3000:]
    drain(db, fleet, deadline=DRAIN_DEADLINE)
    return db, failover, Enqueued.read(out)


def figures_of(
    scenario: str, db: ChaosDatabase, failover: Failover, enqueued: Enqueued, **more: Any
) -> dict[str, Any]:
    first = first_completion_after(db, failover.crashed_at)
    return {
        "scenario": scenario,
        "gap_from_promotion_s": round((first - failover.promoted_at).total_seconds(), 2),
        "gap_from_crash_s": round((first - failover.crashed_at).total_seconds(), 2),
        "promotion_s": round((failover.promoted_at - failover.crashed_at).total_seconds(), 2),
        "enqueued_committed": len(enqueued.committed),
        "enqueued_in_doubt": enqueued.in_doubt,
        **more,
    }


@pytest.mark.timeout(TIMEOUT)
def test_synchronous_failover_loses_no_committed_job_and_completes_none_twice(
    build_cluster: Any, fleet_on: Any, tmp_path: Path, seed: int
) -> None:
    cluster: Topology = build_cluster(True)
    fleet: HostFleet = fleet_on(cluster)
    db, failover, enqueued = run_failover(cluster, fleet, tmp_path / "enqueued.jsonl", seed)
    try:
        ids = sorted(set(enqueued.committed) | present(db))
        assert enqueued.reissued == {}, f"ids issued twice: {sorted(enqueued.reissued)[:20]}"
        verdict = judge(db, ids)
        lost_claims = explain_lost_claims(verdict, failover.crashed_at)
        pids = {w.pid for w in fleet.workers}
        verdict.assert_sound(
            allowed=ACTED_ON | {LOST_CLAIM}, culprits={"WorkerLost": pids, "LeaseExpired": pids}
        )
        assert all(w.alive for w in fleet.workers)
        record_figures(
            figures_of(
                "synchronous",
                db,
                failover,
                enqueued,
                **verdict.figures(),
                claims_lost_in_crash=lost_claims,
                seed=seed,
            )
        )
    finally:
        db.close()


@pytest.mark.timeout(TIMEOUT)
def test_asynchronous_failover_loses_only_what_the_standby_had_not_received(
    build_cluster: Any, fleet_on: Any, tmp_path: Path, seed: int
) -> None:
    cluster: Topology = build_cluster(False)
    fleet: HostFleet = fleet_on(cluster)
    db, failover, enqueued = run_failover(cluster, fleet, tmp_path / "enqueued.jsonl", seed)
    try:
        ids = sorted(set(enqueued.committed) | present(db))
        first = judge(db, ids)
        # An id the old primary handed out past the standby's position can be handed out
        # again by the new one: its first job is as lost as one whose id is missing.
        lost = {job_id: enqueued.committed.get(job_id) for job_id in first.lost}
        lost.update(enqueued.reissued)
        unexplained = {
            job_id: position
            for job_id, position in lost.items()
            if position is not None and position <= failover.received
        }
        assert unexplained == {}, (
            f"jobs lost although the standby had received their commit "
            f"(received {failover.received:x}): {unexplained}"
        )
        # Everything else is judged as in the synchronous case.
        verdict = judge(db, [i for i in ids if i not in first.lost])
        lost_claims = explain_lost_claims(verdict, failover.crashed_at)
        pids = {w.pid for w in fleet.workers}
        verdict.assert_sound(
            allowed=ACTED_ON | {LOST_CLAIM}, culprits={"WorkerLost": pids, "LeaseExpired": pids}
        )
        assert all(w.alive for w in fleet.workers)
        record_figures(
            figures_of(
                "asynchronous",
                db,
                failover,
                enqueued,
                **verdict.figures(),
                jobs_lost=len(first.lost),
                ids_reissued=len(enqueued.reissued),
                claims_lost_in_crash=lost_claims,
                seed=seed,
            )
        )
    finally:
        db.close()
