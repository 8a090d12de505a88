"""Heartbeats never wait behind another duty.

An application transaction holds a row that the leader's statements need (the leader row
itself, or the registration of a dead worker that rescue deletes). The leader's statement
waits at most its lock_timeout and that pass ends; the heartbeats, on their own
connection and loop, go on extending the running job's lease all along, so the job is
neither rescued nor run twice. (Before, heartbeats ran in the leader's loop, behind the
waiting statement, and the leases ran out.)
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

import psycopg
import pytest

from conftest import wait_until

from .conftest import Ops, StartWorker

pytestmark = pytest.mark.server_version

LEASE = 1.5


def lease_expires_at(ops: Ops, job_id: int) -> datetime | None:
    value = ops.scalar("SELECT lease_expires_at FROM {jobs} WHERE id = %s", (job_id,))
    assert value is None or isinstance(value, datetime)
    return value


def hold_dead_worker_row(ops: Ops, conn: psycopg.Connection[object]) -> None:
    """Register a worker, make it dead (its liveness lock free) and lock its row in
    ``conn``'s open transaction: rescue's delete of the dead registration needs that row."""
    with ops.connect() as owner:
        # Its liveness lock held while it is registered and until its row is locked, so
        # the leader does not delete it first.
        worker_id = ops.worker()
        owner.execute("SELECT pg_advisory_lock(hashtextextended(%s::text, 0))", (str(worker_id),))
        conn.execute(f'SELECT * FROM "{ops.schema}".workers WHERE id = %s FOR UPDATE', (worker_id,))
    # `owner` closed: the lock is free, the worker is dead, its row held by `conn`.


@pytest.mark.timeout(90)
@pytest.mark.parametrize("held", ["leader row", "dead worker row"])
def test_heartbeats_continue_while_an_app_transaction_holds_a_row_the_leader_needs(
    ops: Ops, run_worker: StartWorker, caplog: pytest.LogCaptureFixture, held: str
) -> None:
    caplog.set_level(logging.WARNING, logger="skiplock")
    release = threading.Event()

    @ops.app.task(name="long")
    def long() -> None:
        release.wait(60)

    handle = run_worker(lease_seconds=LEASE, leader_ttl=1.5, rescue_interval=0.1)
    worker = handle.worker
    with psycopg.connect(ops.url) as conn:
        job = long.enqueue(conn)
    wait_until(lambda: ops.state_of(job) == "running", 10, "the job to start")
    wait_until(
        lambda: ops.rows("SELECT worker_id FROM {leader}") == [(worker.id,)], 10, "it to lead"
    )

    try:
        with ops.connect(autocommit=False) as app_conn:
            if held == "leader row":
                app_conn.execute(f'SELECT * FROM "{ops.schema}".leader FOR UPDATE')
            else:
                hold_dead_worker_row(ops, app_conn)
            held_at = ops.now()
            # A beat sent after the lease would have run out, while the row is held.
            wait_until(
                lambda: (
                    (lease_expires_at(ops, job) or held_at)
                    >= held_at + timedelta(seconds=2 * LEASE)
                ),
                20,
                "a heartbeat while the row is held",
            )
            assert ops.rows("SELECT state, worker_id FROM {jobs} WHERE id = %s", (job,)) == [
                ("running", worker.id)
            ]
            app_conn.rollback()
    finally:
        release.set()

    wait_until(lambda: ops.state_of(job) == "completed", 20, "the job to complete")
    assert ops.rows("SELECT attempts, errors FROM {history} WHERE id = %s", (job,)) == [(1, [])]
    assert worker.stats.lost_leases == 0
    assert worker.stats.rescued == 0
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.timeout(90)
def test_a_running_job_locked_by_an_app_holds_up_no_other_lease(
    ops: Ops, run_worker: StartWorker
) -> None:
    """An application transaction locks one of the worker's running jobs for longer than
    the lease. The heartbeat does not wait for it: the worker's other job keeps its lease
    extended, and the locked one is not taken for lost while the lock lasts."""
    release = threading.Event()

    @ops.app.task(name="long")
    def long() -> None:
        release.wait(60)

    handle = run_worker(lease_seconds=LEASE, concurrency=2)
    worker = handle.worker
    with psycopg.connect(ops.url) as conn:
        locked, other = long.enqueue(conn), long.enqueue(conn)
    wait_until(
        lambda: {ops.state_of(locked), ops.state_of(other)} == {"running"}, 10, "both to start"
    )

    try:
        with ops.connect(autocommit=False) as app_conn:
            app_conn.execute(
                f'SELECT * FROM "{ops.schema}".jobs WHERE id = %s FOR UPDATE', (locked,)
            )
            held_at = ops.now()
            wait_until(
                lambda: (
                    (lease_expires_at(ops, other) or held_at)
                    >= held_at + timedelta(seconds=2 * LEASE)
                ),
                20,
                "the other job's heartbeat while one row is locked",
            )
            assert worker.stats.lost_leases == 0
            app_conn.rollback()
    finally:
        release.set()

    wait_until(lambda: ops.state_of(other) == "completed", 20, "the other job to complete")
    assert ops.rows("SELECT attempts, errors FROM {history} WHERE id = %s", (other,)) == [(1, [])]
    # The locked job's own lease could not be extended while it was locked: it completes,
    # on this attempt or, if the leader found its lease expired first, on a later one.
    wait_until(lambda: ops.state_of(locked) == "completed", 30, "the locked job to complete")
