"""Inserts notify only while a worker waits on their queue; busy workers find late commits
without any notification (decision 023).

The sentinel keys (sql/wakeup.py) are exercised from plain connections, as a worker's
wake-up session holds them; the worker tests use real workers whose poll interval and
deep probe are far longer than the test waits, so that only a notification (idle) or the
late-commit read (busy) can have found the job.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import JobFactory, Listener, StartWorker, wait_until
from skiplock.cursor import ClaimCursor, LateReads
from skiplock.sql import render, wakeup
from skiplock.worker.wakeup import LateCommits, WakeupSession

pytestmark = pytest.mark.server_version

SCHEMA = "skiplock"
SLOW_POLL = {"poll_interval": 30.0, "sweep_interval": 60.0}


def arm(conn: psycopg.Connection[Any], queue: str = "default") -> str:
    row = conn.execute(
        render(wakeup.SENTINEL_ARM, SCHEMA), {"queue": queue, "schema": SCHEMA}
    ).fetchone()
    assert row is not None
    return str(row[0])


def test_an_insert_that_no_worker_waits_for_sends_no_notification(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    task = app.task(name="t")(lambda: None)
    with psycopg.connect(database_url) as conn:
        task.enqueue(conn)
        conn.execute("INSERT INTO skiplock.jobs (task) VALUES ('t')")
        app.enqueue_many(conn, [task.job() for _ in range(5)])

    assert listener.collect() == []


def test_a_sentinel_makes_inserts_into_its_queue_notify_and_no_other(
    app: skiplock.App, autocommit: psycopg.Connection[Any], listener: Listener
) -> None:
    listener.wait_on("emails")
    autocommit.execute("INSERT INTO skiplock.jobs (task, queue) VALUES ('t', 'emails')")
    autocommit.execute("INSERT INTO skiplock.jobs (task, queue) VALUES ('t', 'sms')")

    assert listener.collect() == ["emails"]


def test_a_worker_cannot_become_sentinel_while_an_insert_that_saw_none_is_in_flight(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    """The race of a worker going to sleep while an insert commits: the insert holds the
    waiting key shared until it ends, so arming waits for it, and the claim after arming
    sees its job."""
    with psycopg.connect(database_url, autocommit=True) as worker:
        with psycopg.connect(database_url) as inserter:
            inserter.execute("INSERT INTO skiplock.jobs (task) VALUES ('t')")
            assert arm(worker) == "in flight"
            inserter.commit()
        assert listener.collect() == []  # it saw no sentinel, and committed before one
        assert arm(worker) == "armed"
        with psycopg.connect(database_url) as inserter:
            inserter.execute("INSERT INTO skiplock.jobs (task) VALUES ('t')")
        assert listener.collect() == ["default"]
        with psycopg.connect(database_url) as inserter:
            inserter.execute("INSERT INTO skiplock.jobs (task) VALUES ('t')")
            inserter.rollback()
        assert listener.collect() == []


def test_a_second_worker_is_covered_by_the_first_sentinel(
    app: skiplock.App, database_url: str
) -> None:
    with (
        psycopg.connect(database_url, autocommit=True) as first,
        psycopg.connect(database_url, autocommit=True) as second,
    ):
        assert arm(first) == "armed"
        assert arm(second) == "covered"
        first.execute(
            render(wakeup.SENTINEL_DISARM, SCHEMA), {"queue": "default", "schema": SCHEMA}
        )
        assert arm(second) == "armed"


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_keys_ignore_snapshots_so_every_isolation_level_notifies(
    app: skiplock.App, database_url: str, listener: Listener, isolation: str
) -> None:
    """A transaction whose snapshot predates the sentinel still sees it: advisory locks
    are not read through snapshots."""
    with psycopg.connect(database_url) as inserter:
        inserter.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        inserter.execute("SELECT count(*) FROM skiplock.jobs")  # the snapshot is taken
        listener.wait_on("default")
        inserter.execute("INSERT INTO skiplock.jobs (task) VALUES ('t')")
    assert listener.collect() == ["default"]


def test_a_job_scheduled_within_a_second_notifies_without_a_sentinel(
    app: skiplock.App, autocommit: psycopg.Connection[Any], listener: Listener
) -> None:
    """Promotion sleeps up to its poll interval: a job due sooner tells it. Its position
    is the lowest priority, so no claim cursor rewinds for it."""
    autocommit.execute(
        "INSERT INTO skiplock.jobs (task, state, run_at) "
        "VALUES ('soon', 'scheduled', now() + interval '300 ms'), "
        "       ('later', 'scheduled', now() + interval '1 hour')"
    )
    notes = list(listener.conn.notifies(timeout=2, stop_after=1))
    assert len(notes) == 1
    queue, priority, _ = notes[0].payload.split("\t")
    assert (queue, priority) == ("default", "32767")
    assert listener.collect() == []


def idle_worker(
    app: skiplock.App, start_worker: StartWorker
) -> tuple[threading.Event, WakeupSession]:
    """A worker with nothing to do, once it holds the default queue's keys; the event is
    set by its task `note`."""
    done = threading.Event()
    app.task(name="note")(done.set)
    handle = start_worker(app, **SLOW_POLL)
    assert handle.worker.parts is not None
    wakeups = handle.worker.parts.wakeups
    assert wakeups is not None
    wait_until(lambda: "default" in wakeups.armed, 10, "the worker to arm its queue")
    return done, wakeups


def test_an_idle_worker_is_woken_by_a_plain_sql_insert(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    """An idle worker holds its queue's keys; a plain INSERT then notifies and the job
    starts long before the 30 s poll."""
    done, wakeups = idle_worker(app, start_worker)

    autocommit.execute("INSERT INTO skiplock.jobs (task) VALUES ('note')")

    assert done.wait(10)
    # Woken, it let the keys go, and took them again once the queue was empty.
    wait_until(lambda: "default" in wakeups.armed, 10, "the worker to arm its queue again")


def test_a_busy_worker_finds_a_job_that_committed_behind_its_cursor(
    app: skiplock.App, start_worker: StartWorker, database_url: str
) -> None:
    """A transaction inserts a job, then stays open while later jobs commit and are
    claimed past the job's position; it commits with nobody told. A session holds the
    queue's waiting key shared all along, as an insert in flight would, so the worker can
    never arm and no insert notifies. Only the late-commit read (every 20 ms) can find the
    job within the wait: the poll and the deep probe are far longer."""
    seen: list[str] = []

    @app.task(name="mark")
    def mark(name: str) -> None:
        seen.append(name)

    waiting_key = (
        "SELECT pg_advisory_lock_shared(hashtextextended('default', "
        "hashtextextended('skiplock.waiting', 0)))"
    )
    with psycopg.connect(database_url, autocommit=True) as in_flight:
        in_flight.execute(waiting_key)
        start_worker(app, **SLOW_POLL)
        with psycopg.connect(database_url) as late, psycopg.connect(database_url) as other:
            mark.enqueue(late, name="late")  # run_at: this transaction's start
            for n in range(20):
                mark.enqueue(other, name=f"later-{n}")
                other.commit()
            wait_until(lambda: len(seen) >= 20, 10, "the later jobs to run")
            late.commit()
        wait_until(lambda: "late" in seen, 10, "the late commit to be found")


def test_the_late_read_rewinds_a_cursor_past_a_job_that_committed_late(
    app: skiplock.App, database_url: str, make_job: JobFactory
) -> None:
    """The mechanism alone: a cursor past the job's position, the job committed by a
    transaction that was open at the previous read, the next read rewinds to it."""

    async def scenario() -> tuple[ClaimCursor, int, int]:
        session = WakeupSession(database_url, SCHEMA)
        cursor = ClaimCursor()
        found: list[str] = []
        late = LateCommits(session, SCHEMA, {"default": cursor}, [], every=1, on_found=found.append)
        try:
            await late.run_once()  # the first read only takes a snapshot
            with psycopg.connect(database_url) as open_tx:
                open_tx.execute("INSERT INTO skiplock.jobs (task, priority) VALUES ('x', 5)")
                await late.run_once()  # the transaction is in progress: pending
                ahead = make_job(task="y", priority=0)
                cursor.start()
                cursor.advance([(9, datetime.now(UTC) + timedelta(days=1), ahead)])
            await late.run_once()
            assert found == ["default"]
            row = (
                psycopg.connect(database_url)
                .execute("SELECT id FROM skiplock.jobs WHERE task = 'x'")
                .fetchone()
            )
            assert row is not None
            return cursor, ahead, int(row[0])
        finally:
            await session.close()

    cursor, ahead, late_id = asyncio.run(scenario())
    assert cursor.position is not None
    # Before the earliest of the two new jobs (the one at priority 0), hence before the
    # late one at priority 5 too.
    assert cursor.position[:1] == (0,)
    assert cursor.position[2] == ahead - 1
    assert late_id != ahead


def test_a_transaction_held_open_elsewhere_costs_the_late_read_nothing_per_job(
    app: skiplock.App, database_url: str, autocommit: psycopg.Connection[Any]
) -> None:
    """A VACUUM horizon held back (a transaction with an xid left open) keeps every dead
    entry in jobs_enqueued. The late read resumes after the previous snapshot, so it reads
    none of the entries consumed before it: index tuples read stay flat. (The read runs on
    this test's own connection, whose statistics it flushes at once.)"""
    statement = render(wakeup.JOB_LATE_COMMITS, SCHEMA)
    reads = LateReads()

    def read(reader: psycopg.Connection[Any], n: int) -> None:
        for _ in range(n):
            rows = reader.execute(statement, reads.params(["default"], [])).fetchall()
            reads.read(["default"], rows)

    def tuples_read(reader: psycopg.Connection[Any]) -> int:
        reader.execute("SELECT pg_stat_force_next_flush()")
        reader.execute("SELECT 1")  # the flush happens at the end of a transaction
        autocommit.execute("SELECT pg_stat_clear_snapshot()")
        row = autocommit.execute(
            "SELECT idx_tup_read FROM pg_stat_user_indexes "
            "WHERE schemaname = 'skiplock' AND indexrelname = 'jobs_enqueued'"
        ).fetchone()
        assert row is not None
        return int(row[0])

    with (
        psycopg.connect(database_url) as holder,
        psycopg.connect(database_url, autocommit=True) as reader,
    ):
        holder.execute("SELECT pg_current_xact_id()")  # now idle in transaction
        read(reader, 1)
        autocommit.execute(
            "INSERT INTO skiplock.jobs (task) SELECT 'x' FROM generate_series(1, 2000)"
        )
        read(reader, 3)  # read once, through the limit
        # Consumed, as claims would: dead entries the horizon keeps.
        autocommit.execute("UPDATE skiplock.jobs SET state = 'dead'")
        before = tuples_read(reader)
        read(reader, 20)
        after = tuples_read(reader)
    # Twenty reads of a held horizon with 2,000 dead entries: reads from the start of the
    # index would account for 40,000.
    assert after - before < 100, after - before


def test_a_worker_whose_wakeup_session_is_killed_arms_again(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    """The keys go with the session; the worker notices within a second (it pings an idle
    session), connects again and arms, so inserts wake it again long before the poll."""
    done, wakeups = idle_worker(app, start_worker)

    def wakeup_pid() -> int | None:
        row = autocommit.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE '%%wakeup%%'"
        ).fetchone()
        return None if row is None else int(row[0])

    killed = wakeup_pid()
    assert killed is not None
    autocommit.execute("SELECT pg_terminate_backend(%s)", (killed,))
    wait_until(
        lambda: wakeup_pid() not in (None, killed) and "default" in wakeups.armed,
        10,
        "the worker to arm its queue on a new session",
    )
    autocommit.execute("INSERT INTO skiplock.jobs (task) VALUES ('note')")

    assert done.wait(10)


def test_a_session_posing_as_sentinel_only_makes_inserts_notify(
    app: skiplock.App, start_worker: StartWorker, database_url: str
) -> None:
    """Anyone can take advisory locks. One that holds a queue's keys as a sentinel would
    makes every insert notify (the cost before decision 023), and the worker, covered,
    is woken by those notifications."""
    done = threading.Event()
    app.task(name="note")(done.set)
    with psycopg.connect(database_url, autocommit=True) as impostor:
        assert arm(impostor) == "armed"
        handle = start_worker(app, **SLOW_POLL)
        assert handle.worker.parts is not None
        wakeups = handle.worker.parts.wakeups
        assert wakeups is not None
        wait_until(lambda: "default" in wakeups.covered, 10, "the worker to find it covered")
        with psycopg.connect(database_url) as conn:
            conn.execute("INSERT INTO skiplock.jobs (task) VALUES ('note')")
        assert done.wait(10)


def test_a_stopping_sentinel_hands_over_to_the_worker_it_covered(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    """The second worker sleeps on the first one's notifications; when the first stops,
    it says so, and the second arms and is woken by inserts again long before its poll."""
    done = threading.Event()
    app.task(name="note")(done.set)
    first = start_worker(app, **SLOW_POLL)
    assert first.worker.parts is not None
    first_keys = first.worker.parts.wakeups
    assert first_keys is not None
    wait_until(lambda: "default" in first_keys.armed, 10, "the first worker to arm")
    second = start_worker(app, **SLOW_POLL)
    assert second.worker.parts is not None
    second_keys = second.worker.parts.wakeups
    assert second_keys is not None
    wait_until(lambda: "default" in second_keys.covered, 10, "the second worker to be covered")

    first.stop()
    wait_until(lambda: "default" in second_keys.armed, 10, "the second worker to arm")
    autocommit.execute("INSERT INTO skiplock.jobs (task) VALUES ('note')")

    assert done.wait(10)
