"""skiplock.testing through the plugin's fixtures: the assertions and their messages,
perform_job as a worker runs a handler, and drain inside the test's transaction."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import skiplock
from integrations import shop
from skiplock import client
from skiplock.testing import (
    assert_enqueued,
    drain,
    drain_async,
    enqueued_jobs,
    perform_job,
    perform_job_async,
    refute_enqueued,
)

Conn = psycopg.Connection[Any]


@pytest.fixture
def orders(skiplock_conn: Conn) -> Conn:
    """The shop's orders table with orders 1 and 2, in the test's transaction."""
    skiplock_conn.execute(shop.ORDERS_TABLE)
    skiplock_conn.execute("INSERT INTO shop_orders (id) VALUES (1), (2)")
    return skiplock_conn


def paid(conn: Conn) -> list[int]:
    return [r[0] for r in conn.execute("SELECT id FROM shop_orders WHERE paid ORDER BY id")]


# -- assertions ------------------------------------------------------------------------


def test_assert_enqueued_returns_the_matching_job(skiplock_conn: Conn) -> None:
    shop.send_receipt.enqueue(skiplock_conn, order_id=1, email="a@example.com")
    ref = shop.send_receipt.enqueue(skiplock_conn, order_id=2)

    job = assert_enqueued(skiplock_conn, shop.send_receipt, args={"order_id": 2}, queue="emails")

    assert job.id == ref
    assert job.args == {"order_id": 2}
    assert job.state is skiplock.JobState.AVAILABLE
    assert assert_enqueued(skiplock_conn, shop.send_receipt, count=2).args["order_id"] == 1


def test_a_failed_assertion_lists_what_was_enqueued(skiplock_conn: Conn) -> None:
    first = shop.send_receipt.enqueue(skiplock_conn, order_id=1)
    later = shop.charge_card.with_options(delay=60).enqueue(skiplock_conn, order_id=1, amount=9.5)

    with pytest.raises(AssertionError) as failed:
        assert_enqueued(skiplock_conn, shop.send_receipt, args={"order_id": 2}, queue="emails")

    assert str(failed.value) == (
        "expected a job of shop.send_receipt with arguments (order_id=2) in queue 'emails'; "
        "none was enqueued.\n"
        "Enqueued jobs (2):\n"
        f"  #{first} shop.send_receipt(order_id=1) queue='emails' available\n"
        f"  #{later} shop.charge_card(amount=9.5, order_id=1) queue='default' scheduled, "
        "due in 60s"
    )


def test_nothing_enqueued_is_said_plainly(skiplock_conn: Conn) -> None:
    with pytest.raises(AssertionError, match=r"none was enqueued.\nEnqueued jobs: none.$"):
        assert_enqueued(skiplock_conn, shop.send_receipt)


def test_scheduled_within_bounds_the_due_time(skiplock_conn: Conn) -> None:
    shop.send_receipt.with_options(delay=60).enqueue(skiplock_conn, order_id=1)

    assert_enqueued(skiplock_conn, shop.send_receipt, scheduled_within=61)
    assert_enqueued(skiplock_conn, shop.send_receipt, scheduled_within=timedelta(minutes=2))
    assert_enqueued(skiplock_conn, shop.send_receipt, scheduled_within=(59, 61))
    with pytest.raises(
        AssertionError, match=r"expected a job of shop\.send_receipt due within 30s"
    ):
        assert_enqueued(skiplock_conn, shop.send_receipt, scheduled_within=30)
    with pytest.raises(AssertionError, match="due in 0s to 10s; none was enqueued"):
        assert_enqueued(skiplock_conn, shop.send_receipt, scheduled_within=(0, 10))


def test_count_must_match_exactly(skiplock_conn: Conn) -> None:
    shop.send_receipt.enqueue(skiplock_conn, order_id=1)
    shop.send_receipt.enqueue(skiplock_conn, order_id=1)

    assert_enqueued(skiplock_conn, shop.send_receipt, args={"order_id": 1}, count=2)
    with pytest.raises(AssertionError, match=r"expected 1 x job of .*; 2 were enqueued"):
        assert_enqueued(skiplock_conn, shop.send_receipt, count=1)
    with pytest.raises(ValueError, match="use refute_enqueued"):
        assert_enqueued(skiplock_conn, shop.send_receipt, count=0)


def test_refute_enqueued_lists_the_jobs_that_match(skiplock_conn: Conn) -> None:
    refute_enqueued(skiplock_conn, shop.send_receipt)
    ref = shop.send_receipt.enqueue(skiplock_conn, order_id=7)
    refute_enqueued(skiplock_conn, shop.send_receipt, args={"order_id": 8})

    with pytest.raises(AssertionError) as failed:
        refute_enqueued(skiplock_conn, shop.send_receipt, args={"order_id": 7})

    assert str(failed.value) == (
        "expected no job of shop.send_receipt with arguments (order_id=7); found:\n"
        "Matching jobs (1):\n"
        f"  #{ref} shop.send_receipt(order_id=7) queue='emails' available"
    )


def test_enqueued_jobs_compares_arguments_as_stored(skiplock_conn: Conn) -> None:
    shop.notify_warehouse.enqueue(skiplock_conn, order_id=1, items=("lamp", "desk"))
    shop.send_receipt.enqueue(skiplock_conn, order_id=1)

    found = enqueued_jobs(skiplock_conn, shop.notify_warehouse, args={"items": ("lamp", "desk")})

    assert [job.args for job in found] == [{"order_id": 1, "items": ["lamp", "desk"]}]
    assert [job.task for job in enqueued_jobs(skiplock_conn, shop.app)] == [
        "shop.notify_warehouse",
        "shop.send_receipt",
    ]
    assert enqueued_jobs(skiplock_conn, shop.app, queue="emails")[0].task == "shop.send_receipt"


def test_the_connection_rolls_back_and_cannot_commit(
    skiplock_conn: Conn, skiplock_app: skiplock.App
) -> None:
    shop.send_receipt.enqueue(skiplock_conn, order_id=1)
    with psycopg.connect(skiplock_app.database_url) as other:
        assert enqueued_jobs(other, shop.app) == []  # not committed: nobody else sees it

    with pytest.raises(psycopg.ProgrammingError):
        skiplock_conn.commit()


# -- perform_job -------------------------------------------------------------------------


def test_perform_job_runs_the_handler_as_a_worker_would() -> None:
    outcome = perform_job(shop.send_receipt, order_id=3)

    assert outcome.completed
    assert outcome.result == {"order_id": 3, "to": "buyer@example.com", "job": 0, "attempt": 1}
    assert str(outcome) == (
        "#0 shop.send_receipt(order_id=3): completed -> "
        "{'order_id': 3, 'to': 'buyer@example.com', 'job': 0, 'attempt': 1}"
    )


def test_perform_job_round_trips_arguments_and_result_through_json() -> None:
    outcome = perform_job(shop.notify_warehouse, order_id=1, items=("lamp", "desk"))

    assert outcome.args == {"order_id": 1, "items": ["lamp", "desk"]}
    assert outcome.result == ["1:lamp", "1:desk"]
    assert outcome.progress == {"notified": 2}
    assert perform_job(shop.odd_result).result == {"repr": "{1, 2}"}


def test_perform_job_records_failures_as_a_worker_does() -> None:
    retried = perform_job(shop.charge_card, order_id=1, amount=5.0)
    dead = perform_job(shop.charge_card.with_options(max_attempts=1), order_id=1, amount=5.0)
    later = perform_job(shop.call_back_later, order_id=1)
    snoozed = perform_job(shop.not_yet, order_id=1)

    assert retried.kind == "retried"
    assert retried.error is not None
    assert retried.error["type"] == "RuntimeError"
    assert retried.error["message"] == "card declined for order 1"
    assert "raise RuntimeError" in retried.error["traceback"]
    assert 0 < retried.delay <= 1
    assert dead.kind == "dead"
    assert (later.kind, later.delay) == ("retried", 30)
    assert (snoozed.kind, snoozed.delay) == ("snoozed", 60)


def test_perform_job_checks_arguments_as_enqueue_does() -> None:
    with pytest.raises(skiplock.EnqueueError, match="order_id"):
        perform_job(shop.send_receipt, email="a@example.com")
    with pytest.raises(skiplock.EnqueueError, match="argument 'amount'"):
        perform_job(shop.charge_card, order_id=1, amount=float("nan"))


def test_a_transactional_handler_runs_in_a_savepoint_of_the_connection(orders: Conn) -> None:
    outcome = perform_job(shop.mark_paid, orders, order_id=1)
    failed = perform_job(shop.pay_then_fail, orders, order_id=2)

    assert (outcome.kind, outcome.result) == ("completed", 1)
    assert failed.kind == "retried"
    assert failed.error is not None
    assert failed.error["message"] == "the payment service hung up"
    assert paid(orders) == [1]  # the failed handler's write was rolled back
    assert_enqueued(orders, shop.send_receipt, args={"order_id": 1})


def test_perform_job_says_when_a_connection_is_wanted_or_not(orders: Conn) -> None:
    with pytest.raises(TypeError, match=r"shop\.mark_paid is transactional: pass the psycopg"):
        perform_job(shop.mark_paid, order_id=1)
    with pytest.raises(TypeError, match=r"shop\.send_receipt is not transactional"):
        perform_job(shop.send_receipt, orders, order_id=1)
    with pytest.raises(TypeError, match="use perform_job_async"):
        perform_job(shop.mark_shipped, order_id=1)

    async def the_other_way() -> None:
        with pytest.raises(TypeError, match=r"use perform_job$"):
            await perform_job_async(shop.mark_paid, order_id=1)
        with pytest.raises(TypeError, match=r"shop\.mark_shipped is transactional: pass the "):
            await perform_job_async(shop.mark_shipped, order_id=1)

    asyncio.run(the_other_way())


def test_perform_job_async_and_sync_helpers_inside_an_event_loop(
    skiplock_app: skiplock.App,
) -> None:
    async def scenario() -> tuple[list[Any], Any, Any]:
        async with await psycopg.AsyncConnection.connect(skiplock_app.database_url) as conn:
            await conn.execute(shop.ORDERS_TABLE)
            await conn.execute("INSERT INTO shop_orders (id) VALUES (1)")
            shipped = await perform_job_async(shop.mark_shipped, conn, order_id=1)
            cur = await conn.execute("SELECT id FROM shop_orders WHERE shipped")
            rows = await cur.fetchall()
            await conn.rollback()
        warehouse = await perform_job_async(shop.notify_warehouse, order_id=2, items=["x"])
        inside_a_loop = perform_job(shop.send_receipt, order_id=4)  # a sync helper
        return [shipped.result, rows], warehouse.result, inside_a_loop.result["order_id"]

    assert asyncio.run(scenario()) == ([True, [(1,)]], ["2:x"], 4)


# -- drain -------------------------------------------------------------------------------


def test_drain_runs_every_ready_job_in_the_tests_transaction(
    orders: Conn, skiplock_app: skiplock.App
) -> None:
    pay_1 = shop.mark_paid.enqueue(orders, order_id=1)
    shop.mark_paid.enqueue(orders, order_id=2)
    notify = shop.notify_warehouse.enqueue(orders, order_id=1, items=["lamp"])
    charge = shop.charge_card.enqueue(orders, order_id=1, amount=5.0)
    shop.send_receipt.with_options(delay=60).enqueue(orders, order_id=9)  # not ready

    outcomes = drain(orders, skiplock_app)

    assert [(o.task, o.kind) for o in outcomes] == [
        ("shop.notify_warehouse", "completed"),
        ("shop.charge_card", "retried"),
        ("shop.mark_paid", "completed"),
        ("shop.mark_paid", "completed"),
        ("shop.send_receipt", "completed"),  # enqueued by mark_paid
        ("shop.send_receipt", "completed"),
    ]
    assert [o.result for o in outcomes if o.task == "shop.send_receipt"] == [
        {"order_id": 1, "to": "buyer@example.com", "job": outcomes[4].job_id, "attempt": 1},
        {"order_id": 2, "to": "buyer@example.com", "job": outcomes[5].job_id, "attempt": 1},
    ]
    assert outcomes[0].progress == {"notified": 1}
    assert paid(orders) == [1, 2]
    # As a worker leaves them: finished jobs in history, the failed one waiting to retry.
    assert client.get_job(orders, skiplock_app.schema, pay_1).state is skiplock.JobState.COMPLETED
    assert client.get_job(orders, skiplock_app.schema, notify).result == ["1:lamp"]
    retrying = client.get_job(orders, skiplock_app.schema, charge)
    assert (retrying.state, retrying.attempts) == (skiplock.JobState.RETRYABLE, 1)
    assert retrying.last_error == "RuntimeError: card declined for order 1"
    assert_enqueued(orders, shop.send_receipt, args={"order_id": 9}, scheduled_within=(59, 61))
    assert drain(orders, skiplock_app) == []


def test_drain_keeps_to_the_queues_it_is_given(
    skiplock_conn: Conn, skiplock_app: skiplock.App
) -> None:
    shop.send_receipt.enqueue(skiplock_conn, order_id=1)
    shop.notify_warehouse.enqueue(skiplock_conn, order_id=1, items=[])

    outcomes = drain(skiplock_conn, skiplock_app, queues=["emails"])

    assert [o.task for o in outcomes] == ["shop.send_receipt"]
    assert_enqueued(skiplock_conn, shop.notify_warehouse)


def test_drain_stops_a_run_without_end(skiplock_conn: Conn, skiplock_app: skiplock.App) -> None:
    for order_id in range(3):
        shop.send_receipt.enqueue(skiplock_conn, order_id=order_id)

    with pytest.raises(AssertionError, match=r"drain ran 2 jobs and more are ready"):
        drain(skiplock_conn, skiplock_app, max_runs=2)


def test_async_transactional_jobs_need_drain_async(
    orders: Conn, skiplock_app: skiplock.App
) -> None:
    shop.mark_shipped.enqueue(orders, order_id=1)
    with pytest.raises(
        TypeError, match=r"shop.mark_shipped is an async transactional.*drain_async"
    ):
        drain(orders, skiplock_app)


def test_drain_async_runs_async_transactional_jobs(skiplock_app: skiplock.App) -> None:
    async def scenario() -> tuple[list[tuple[str, str]], list[Any]]:
        async with await psycopg.AsyncConnection.connect(skiplock_app.database_url) as conn:
            await conn.execute(shop.ORDERS_TABLE)
            await conn.execute("INSERT INTO shop_orders (id) VALUES (1)")
            await shop.mark_shipped.enqueue_async(conn, order_id=1)
            await shop.notify_warehouse.enqueue_async(conn, order_id=1, items=["a"])
            outcomes = await drain_async(conn, skiplock_app)
            await conn.rollback()
        return [(o.task, o.kind) for o in outcomes], [o.result for o in outcomes]

    assert asyncio.run(scenario()) == (
        [("shop.notify_warehouse", "completed"), ("shop.mark_shipped", "completed")],
        [["1:a"], True],
    )


def test_drain_says_why_it_left_jobs_committed_after_its_transaction_began(
    skiplock_conn: Conn, skiplock_app: skiplock.App
) -> None:
    refute_enqueued(skiplock_conn, shop.send_receipt)  # the test's transaction has begun
    with psycopg.connect(skiplock_app.database_url, autocommit=True) as other:
        ref = shop.send_receipt.enqueue(other, order_id=5)  # as code under test would

        with pytest.raises(AssertionError) as failed:
            drain(skiplock_conn, skiplock_app)
        outcomes = drain(other, skiplock_app)  # its outcome commits

    assert str(failed.value).startswith(
        "drain left 1 ready job(s) committed after this connection's transaction began"
    )
    assert f"#{ref} shop.send_receipt(order_id=5) queue='emails' available" in str(failed.value)
    assert [(o.job_id, o.kind) for o in outcomes] == [(ref, "completed")]
