"""Chaos, lock stall: an application transaction holds, for a while, a row the leader
needs and a key that admission needs, while real worker processes run long jobs on
short leases and one of them is SIGKILLed.

The transaction holds the registration (and running job) of a dead worker, which the
leader's rescue would delete, and an uncommitted admitted job of a one-at-a-time
ordering key, which admission of that key's waiting job must wait for. Each leader
statement waits at most its lock_timeout and that pass ends; meanwhile:

- heartbeats go on: no running job of a live worker ever has an expired lease, and none
  is rescued or run twice;
- rescue goes on: the SIGKILLed worker's jobs are given back during the stall;
- no service is restarted (a lock timeout is not a crash);
- once the transaction ends, the dead worker's job is rescued and the keyed job admitted.

The stall lasts 10 s at the default size and 30 s in large runs (``scripts/chaos --jobs
N`` above the default), with a 3 s lease: a heartbeat held up by the stall would let
leases run out several times over.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest

from conftest import wait_until
from processes import WorkerProcess

from .chaos_app import ASYNC_TASK, QUEUE, work_async, work_sync
from .conftest import (
    DEFAULT_JOBS,
    JOBS,
    SCHEMA,
    ChaosDatabase,
    Fleet,
    record_figures,
)
from .test_chaos import completed, enqueue, judge

pytestmark = pytest.mark.chaos

STALL = 10.0 if JOBS <= DEFAULT_JOBS else 30.0
LEASE = 3.0
WORKERS = 3
PER_WORKER = 2
POLL = 0.05
KEY = "lock-stall"


def running_by(db: ChaosDatabase) -> dict[Any, int]:
    """worker_id -> running jobs."""
    rows = db.conn.execute(
        f"SELECT worker_id, count(*) FROM {SCHEMA}.jobs WHERE state = 'running' GROUP BY 1"
    ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def worker_ids(db: ChaosDatabase) -> dict[int, Any]:
    """pid -> worker id of every registered worker."""
    rows = db.conn.execute(f"SELECT pid, id FROM {SCHEMA}.workers").fetchall()
    return {int(r[0]): r[1] for r in rows}


def leader_pid(db: ChaosDatabase) -> int | None:
    row = db.conn.execute(
        f"SELECT w.pid FROM {SCHEMA}.leader AS l JOIN {SCHEMA}.workers AS w "
        "ON w.id = l.worker_id WHERE l.expires_at > now()"
    ).fetchone()
    return None if row is None else int(row[0])


def expired_leases(db: ChaosDatabase, live: list[Any]) -> list[tuple[Any, ...]]:
    """Running jobs of live workers whose lease has run out: a missed heartbeat."""
    return db.conn.execute(
        f"SELECT id, worker_id, lease_expires_at, now() FROM {SCHEMA}.jobs "
        "WHERE state = 'running' AND worker_id = ANY(%s) AND lease_expires_at < now()",
        (live,),
    ).fetchall()


def stage_dead_worker(db: ChaosDatabase, app_tx: psycopg.Connection[Any]) -> tuple[Any, int]:
    """A registered worker with a running job, dead (its liveness lock free) by the time
    this returns, its registration and job locked by ``app_tx``'s open transaction."""
    ghost = uuid.uuid4()
    with psycopg.connect(db.url, autocommit=True) as owner:
        # Held until app_tx has the rows, so the leader does not rescue it first.
        owner.execute("SELECT pg_advisory_lock(hashtextextended(%s::text, 0))", (str(ghost),))
        db.conn.execute(
            f"INSERT INTO {SCHEMA}.workers (id, host, pid, queues, concurrency, holds_lock) "
            "VALUES (%s, 'ghost', 1, %s, 1, true)",
            (ghost, [QUEUE]),
        )
        row = db.conn.execute(
            f"INSERT INTO {SCHEMA}.jobs (queue, task, args, state, attempts, max_attempts, "
            "worker_id, lease_expires_at, attempted_at) "
            "VALUES (%s, %s, '{\"ms\": 1}', 'running', 1, 50, %s, "
            "        now() + interval '1 hour', now()) RETURNING id",
            (QUEUE, ASYNC_TASK, ghost),
        ).fetchone()
        assert row is not None
        app_tx.execute(f"SELECT 1 FROM {SCHEMA}.workers WHERE id = %s FOR UPDATE", (ghost,))
        app_tx.execute(f"SELECT 1 FROM {SCHEMA}.jobs WHERE id = %s FOR UPDATE", (row[0],))
    return ghost, int(row[0])


@pytest.mark.timeout(STALL * 4 + 120)
def test_a_lock_stall_delays_one_pass_never_heartbeats_nor_rescue(
    chaos_db: ChaosDatabase, fleet: Fleet
) -> None:
    conn = chaos_db.conn
    long_ms = int((STALL + 2 * LEASE) * 1000)
    fleet.start_many(WORKERS, conn, concurrency=PER_WORKER, lease=LEASE, poll_interval=POLL)
    specs = [
        (work_sync if i % 2 else work_async).job(ms=long_ms) for i in range(WORKERS * PER_WORKER)
    ]
    ids = enqueue(chaos_db, specs)
    pids = worker_ids(chaos_db)
    wait_until(
        lambda: sorted(running_by(chaos_db).values()) == [PER_WORKER] * WORKERS,
        30,
        interval=POLL,
        what="every worker to run its share of the long jobs",
        check=fleet.check,
    )
    leader = wait_until(lambda: leader_pid(chaos_db), 30, interval=POLL, what="a leader")
    victim: WorkerProcess = next(w for w in fleet.workers if w.pid != leader)
    live = [worker_id for pid, worker_id in pids.items() if pid != victim.pid]

    app_tx = psycopg.connect(chaos_db.url)
    try:
        ghost, ghost_job = stage_dead_worker(chaos_db, app_tx)
        # An admitted job of a one-at-a-time key, not yet committed: admitting the key's
        # waiting job needs its place in the unique index jobs_key_single.
        app_tx.execute(
            f"INSERT INTO {SCHEMA}.jobs (queue, task, args, state, ordering_key, key_limit) "
            "VALUES (%s, %s, '{\"ms\": 1}', 'available', %s, 1)",
            (QUEUE, ASYNC_TASK, KEY),
        )
        (keyed,) = enqueue(chaos_db, [work_async.with_options(ordering_key=KEY).job(ms=1)])
        stalled_at = time.monotonic()
        killed_at: float | None = None
        rescued_after: float | None = None
        checks = 0
        while time.monotonic() < stalled_at + STALL:
            fleet.check()
            checks += 1
            assert expired_leases(chaos_db, live) == []
            now = time.monotonic()
            if killed_at is None and now >= stalled_at + STALL / 3:
                fleet.kill(victim)
                killed_at = time.monotonic()
            if (
                killed_at is not None
                and rescued_after is None
                and running_by(chaos_db).get(pids[victim.pid], 0) == 0
            ):
                rescued_after = time.monotonic() - killed_at
            time.sleep(POLL)
        assert rescued_after is not None, "the killed worker's jobs were not rescued"
        assert (
            chaos_db.scalar(f"SELECT state FROM {SCHEMA}.jobs WHERE id = %s", (keyed,)) == "blocked"
        )
        assert (
            chaos_db.scalar(f"SELECT worker_id FROM {SCHEMA}.jobs WHERE id = %s", (ghost_job,))
            == ghost
        )
    finally:
        app_tx.rollback()
        app_tx.close()

    everything = [*ids, ghost_job, keyed]
    wait_until(
        lambda: completed(chaos_db, everything),
        long_ms / 1000 * 2 + 60,
        interval=POLL,
        what="every job to complete",
        check=fleet.check,
    )
    verdict = judge(chaos_db, everything)
    # The only re-runs: the SIGKILLed worker's jobs (and the dead worker's, never started).
    verdict.assert_sound({"WorkerLost"}, {"WorkerLost": {victim.pid}})
    rescued = {
        job_id
        for job_id, errors in verdict.errors.items()
        if any(e["type"] == "WorkerLost" for e in errors)
    }
    victims_jobs = {
        job_id
        for job_id, runs in verdict.executions.items()
        if any(e.pid == victim.pid for e in runs)
    }
    assert len(victims_jobs) == PER_WORKER
    assert rescued == victims_jobs | {ghost_job}
    assert all(e["type"] != "LeaseExpired" for errors in verdict.errors.values() for e in errors)
    assert fleet.count_in_logs("failed; restarting") == 0
    lock_timeouts = fleet.count_in_logs("lock timeout")
    assert lock_timeouts >= 1  # admission's passes ended instead of waiting
    record_figures(
        {
            "scenario": "lock stall",
            "mix": "long",
            "stall_seconds": STALL,
            "lease_seconds": LEASE,
            "lease_checks": checks,
            "expired_leases": 0,
            "rescue_after_kill_seconds": round(rescued_after, 2),
            "lock_timeouts_logged": lock_timeouts,
            "rescued_jobs": len(rescued),
            "service_restarts": 0,
        }
    )
