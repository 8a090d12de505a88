"""Leader election: one leader per schema runs the maintenance that must happen once
(rescues, admission, history partitions; periodic ticks are every worker's).

``Leadership`` is pure bookkeeping, tested with a made-up monotonic clock and a seeded
random; the election itself is tested with real in-process workers. A worker's own view
is ``worker.leadership.is_leader(time.monotonic())`` (the event loop's clock is the
monotonic one); the database's view is the row in the ``leader`` table.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg import sql

from conftest import WorkerThread, wait_until
from skiplock import history
from skiplock.leadership import Leadership

from .conftest import Ops, StartWorker

# -- pure bookkeeping --------------------------------------------------------------------


def test_nobody_is_leader_before_winning() -> None:
    leadership = Leadership(ttl=9.0, rng=random.Random(1))

    assert not leadership.is_leader(0.0)
    assert not leadership.is_leader(1e9)
    assert leadership.elections == 0


def test_a_win_lasts_two_thirds_of_the_ttl_from_when_it_was_asked() -> None:
    leadership = Leadership(ttl=9.0, rng=random.Random(1))

    leadership.record(won=True, asked_at=100.0)

    assert leadership.is_leader(100.0)
    assert leadership.is_leader(105.999)
    assert not leadership.is_leader(106.0)
    assert leadership.elections == 1


def test_renewing_is_not_a_new_election() -> None:
    leadership = Leadership(ttl=9.0, rng=random.Random(1))
    leadership.record(won=True, asked_at=100.0)

    leadership.record(won=True, asked_at=103.0)

    assert leadership.is_leader(108.5)
    assert leadership.elections == 1


def test_winning_again_after_the_term_ran_out_is_a_new_election() -> None:
    leadership = Leadership(ttl=9.0, rng=random.Random(1))
    leadership.record(won=True, asked_at=100.0)

    leadership.record(won=True, asked_at=200.0)

    assert leadership.elections == 2


def test_losing_a_vote_or_the_connection_ends_leadership_at_once() -> None:
    leadership = Leadership(ttl=9.0, rng=random.Random(1))
    leadership.record(won=True, asked_at=100.0)
    leadership.record(won=False, asked_at=101.0)
    assert not leadership.is_leader(101.0)

    leadership.record(won=True, asked_at=102.0)
    leadership.lose()
    assert not leadership.is_leader(102.0)


def test_leaders_renew_at_a_third_of_the_ttl() -> None:
    leadership = Leadership(ttl=9.0, rng=random.Random(1))
    leadership.record(won=True, asked_at=100.0)

    assert leadership.next_attempt_in(100.0, follower_every=1.0) == 3.0


def test_followers_retry_with_seeded_jitter() -> None:
    leadership = Leadership(ttl=9.0, rng=random.Random(42))
    same = random.Random(42)

    waits = [leadership.next_attempt_in(0.0, follower_every=2.0) for _ in range(50)]

    assert waits == [2.0 * (0.5 + same.random()) for _ in range(50)]
    assert all(1.0 <= w < 3.0 for w in waits)
    assert len(set(waits)) > 1  # followers do not all race for the row in one instant


@given(
    ttl=st.floats(0.1, 3600.0),
    asked_at=st.floats(0.0, 1e9),
    later=st.floats(0.0, 7200.0),
)
def test_a_leader_stops_believing_before_its_row_can_expire(
    ttl: float, asked_at: float, later: float
) -> None:
    """The row expires ttl after the server's now(), which is after asked_at; the worker
    must have stopped acting as leader by then, on its own clock."""
    leadership = Leadership(ttl=ttl, rng=random.Random(0))
    leadership.record(won=True, asked_at=asked_at)

    if leadership.is_leader(asked_at + later):
        assert later < ttl


# -- elections between real workers ----------------------------------------------------------


def leader_row(ops: Ops) -> uuid.UUID | None:
    rows = ops.rows("SELECT worker_id FROM {leader} WHERE expires_at > now()")
    return None if not rows else rows[0][0]


def leaders(handles: list[WorkerThread]) -> list[WorkerThread]:
    now = time.monotonic()
    return [h for h in handles if h.worker.leadership.is_leader(now)]


def test_two_workers_elect_exactly_one_leader(ops: Ops, run_worker: StartWorker) -> None:
    handles = [run_worker(), run_worker()]

    wait_until(lambda: len(leaders(handles)) == 1, what="a leader")

    # Sample both views for a while: never two leaders, and the row names the one.
    for _ in range(40):
        believing = leaders(handles)
        row = leader_row(ops)
        assert len(believing) <= 1
        if believing:
            assert row == believing[0].worker.id
        assert row in {h.worker.id for h in handles}


def test_when_the_leader_stops_the_other_takes_over(ops: Ops, run_worker: StartWorker) -> None:
    handles = [run_worker(), run_worker()]
    wait_until(lambda: len(leaders(handles)) == 1, what="a leader")
    (leader,) = leaders(handles)
    (follower,) = [h for h in handles if h is not leader]

    leader.stop()  # graceful: it resigns on the way out

    wait_until(
        lambda: (
            follower.worker.leadership.is_leader(time.monotonic())
            and leader_row(ops) == follower.worker.id
        ),
        timeout=3,
        what="the follower to take over",
    )
    assert follower.worker.leadership.elections == 1


def test_a_stopping_leader_resigns(ops: Ops, run_worker: StartWorker) -> None:
    handle = run_worker()
    wait_until(lambda: leader_row(ops) == handle.worker.id, what="it to lead")

    handle.stop()

    assert ops.count("leader") == 0


def test_a_leader_whose_process_is_gone_is_replaced_before_its_term_ends(
    ops: Ops, run_worker: StartWorker
) -> None:
    """The row still has most of its term, but its worker's liveness lock is free."""
    gone = ops.worker(holds_lock=True)
    ops.rows(
        "INSERT INTO {leader} (name, worker_id, expires_at) "
        "VALUES ('maintenance', %s, now() + interval '1 hour')",
        (gone,),
    )

    handle = run_worker()

    wait_until(lambda: leader_row(ops) == handle.worker.id, timeout=5, what="a new leader")
    # The new leader's first rescue removes the dead worker's registration (the election
    # and the rescue are separate statements, so this follows a moment later).
    wait_until(
        lambda: ops.count("workers", "id = %s", (gone,)) == 0,
        timeout=5,
        what="the dead leader's registration to be removed",
    )


@pytest.mark.parametrize("days_ahead", [1, 3])
def test_the_leader_keeps_history_partitions_ahead(
    ops: Ops, run_worker: StartWorker, days_ahead: int
) -> None:
    missing = history.partition_name(
        ops.scalar("SELECT (now() AT TIME ZONE 'UTC')::date + %s", (days_ahead,))
    )
    with ops.connect() as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(ops.table(missing)))

    run_worker()

    wait_until(
        lambda: ops.scalar("SELECT to_regclass(%s) IS NOT NULL", (f"{ops.schema}.{missing}",)),
        what="the leader to create the partition again",
    )
