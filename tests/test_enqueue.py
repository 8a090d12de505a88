"""Enqueue is an ordinary insert in the caller's transaction."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.pq import TransactionStatus

import skiplock
from conftest import Listener

pytestmark = pytest.mark.server_version


def test_rolled_back_enqueue_leaves_no_job(app: skiplock.App, database_url: str) -> None:
    @app.task(name="send_receipt")
    def send_receipt(order_id: int) -> None: ...

    with psycopg.connect(database_url) as conn:
        send_receipt.enqueue(conn, order_id=1)
        conn.rollback()
        count = conn.execute("SELECT count(*) FROM skiplock.jobs").fetchone()
    assert count == (0,)


def test_enqueue_is_visible_after_commit(app: skiplock.App, database_url: str) -> None:
    @app.task(name="send_receipt")
    def send_receipt(order_id: int) -> None: ...

    with psycopg.connect(database_url) as conn:
        job_id = send_receipt.enqueue(conn, order_id=7)
    with psycopg.connect(database_url) as other:
        row: Any = other.execute(
            "SELECT task, args, state, queue FROM skiplock.jobs WHERE id = %s", (job_id,)
        ).fetchone()
    assert row == ("send_receipt", {"order_id": 7}, "available", "default")


def count_jobs(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM skiplock.jobs").fetchone()
    assert row is not None
    return int(row[0])


# -- notifications follow the transaction ----------------------------------------------


def test_rolled_back_enqueue_sends_no_notification(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    task = app.task(name="send_receipt")(lambda order_id: None)

    with psycopg.connect(database_url) as conn:
        task.enqueue(conn, order_id=1)
        conn.rollback()

    assert listener.collect() == []
    assert count_jobs(database_url) == 0


def test_notification_is_sent_at_commit_not_before(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    task = app.task(name="send_receipt", queue="emails")(lambda order_id: None)
    listener.wait_on("emails")

    with psycopg.connect(database_url) as conn:
        task.enqueue(conn, order_id=1)
        before_commit = listener.collect()
        conn.commit()
    after_commit = listener.collect()

    assert before_commit == []
    assert after_commit == ["emails"]


def test_async_enqueue_follows_the_transaction_too(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    task = app.task(name="send_receipt")(lambda order_id: None)
    listener.wait_on("default")

    async def scenario() -> tuple[list[str], list[str], int]:
        async with await psycopg.AsyncConnection.connect(database_url) as aconn:
            await task.enqueue_async(aconn, order_id=1)
            await aconn.rollback()
            after_rollback = listener.collect()
            job_id = await task.enqueue_async(aconn, order_id=2)
            before_commit = listener.collect()
            await aconn.commit()
        return after_rollback + before_commit, listener.collect(), job_id

    early, late, job_id = asyncio.run(scenario())

    assert early == []
    assert late == ["default"]
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT id, args FROM skiplock.jobs").fetchall()
    assert rows == [(job_id, {"order_id": 2})]


def test_plain_sql_insert_works_and_notifies(
    app: skiplock.App, autocommit: psycopg.Connection[Any], listener: Listener
) -> None:
    listener.wait_on("default")
    autocommit.execute("""INSERT INTO skiplock.jobs (task, args) VALUES ('x', '{"a": 1}')""")

    assert listener.collect() == ["default"]
    row = autocommit.execute(
        "SELECT task, args, state, queue, priority, attempts, max_attempts, errors "
        "FROM skiplock.jobs"
    ).fetchone()
    assert row == ("x", {"a": 1}, "available", "default", 0, 0, 3, [])


# -- per-call options ------------------------------------------------------------------


def test_per_call_options_are_stored(app: skiplock.App, conn: psycopg.Connection[Any]) -> None:
    task = app.task(name="report", queue="reports", priority=5, max_attempts=4)(lambda day: None)
    at = datetime(2035, 6, 1, 8, 30, tzinfo=UTC)

    plain = task.enqueue(conn, day=1)
    tuned = task.with_options(queue="urgent", priority=-3, max_attempts=9).enqueue(conn, day=2)
    delayed = task.with_options(delay=90).enqueue(conn, day=3)
    scheduled = task.with_options(run_at=at).enqueue(conn, day=4)
    overdue = task.with_options(run_at=at - timedelta(days=36500)).enqueue(conn, day=5)

    rows = {
        row[0]: row[1:]
        for row in conn.execute(
            "SELECT id, queue, priority, max_attempts, state, run_at, run_at - created_at "
            "FROM skiplock.jobs"
        )
    }
    assert rows[plain][:4] == ("reports", 5, 4, "available")
    assert rows[tuned][:4] == ("urgent", -3, 9, "available")
    assert (rows[delayed][3], rows[delayed][5]) == ("scheduled", timedelta(seconds=90))
    assert rows[scheduled][3:5] == ("scheduled", at)
    assert rows[overdue][3:5] == ("available", at - timedelta(days=36500))


def test_with_options_does_not_change_the_task(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    task = app.task(name="report", queue="reports")(lambda day: None)

    task.with_options(queue="urgent").enqueue(conn, day=1)
    task.enqueue(conn, day=2)

    queues = conn.execute("SELECT queue FROM skiplock.jobs ORDER BY id").fetchall()
    assert queues == [("urgent",), ("reports",)]


# -- many at once ----------------------------------------------------------------------


def test_enqueue_many_inserts_every_job_in_one_statement(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    # A statement-level trigger counts INSERT statements; all of this rolls back.
    conn.execute("CREATE TABLE public.insert_statements (n int NOT NULL)")
    conn.execute("INSERT INTO public.insert_statements VALUES (0)")
    conn.execute(
        "CREATE FUNCTION public.count_insert_statements() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN UPDATE public.insert_statements SET n = n + 1; RETURN NULL; END $$"
    )
    conn.execute(
        "CREATE TRIGGER count_insert_statements AFTER INSERT ON skiplock.jobs "
        "FOR EACH STATEMENT EXECUTE FUNCTION public.count_insert_statements()"
    )
    send = app.task(name="send", queue="emails")(lambda n: None)
    at = datetime(2035, 1, 1, tzinfo=UTC)
    specs = [send.job(n=n) for n in range(50)]
    specs += [
        send.with_options(queue="sms", priority=2, max_attempts=5).job(n=50),
        send.with_options(run_at=at).job(n=51),
        send.with_options(run_at=at - timedelta(days=36500)).job(n=52),
        send.with_options(delay=90).job(n=53),
    ]

    ids = app.enqueue_many(conn, specs)

    assert conn.execute("SELECT n FROM public.insert_statements").fetchone() == (1,)
    rows = conn.execute(
        "SELECT id, args, queue, priority, max_attempts, state, run_at, run_at - created_at "
        "FROM skiplock.jobs ORDER BY id"
    ).fetchall()
    assert [row[0] for row in rows] == ids
    assert [row[1] for row in rows] == [{"n": n} for n in range(54)]
    assert {row[2:6] for row in rows[:50]} == {("emails", 0, 3, "available")}
    assert rows[50][2:6] == ("sms", 2, 5, "available")
    assert rows[51][5:7] == ("scheduled", at)
    assert rows[52][5:7] == ("available", at - timedelta(days=36500))
    assert (rows[53][5], rows[53][7]) == ("scheduled", timedelta(seconds=90))


def test_enqueue_many_sends_one_notification_per_queue(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    send = app.task(name="send", queue="emails")(lambda n: None)
    specs = [send.job(n=n) for n in range(20)]
    specs += [send.with_options(queue="sms").job(n=n) for n in range(20)]
    listener.wait_on("emails", "sms")

    with psycopg.connect(database_url) as conn:
        app.enqueue_many(conn, specs)

    assert sorted(listener.collect()) == ["emails", "sms"]
    assert count_jobs(database_url) == 40


def test_enqueue_many_async(app: skiplock.App, database_url: str, listener: Listener) -> None:
    send = app.task(name="send")(lambda n: None)
    listener.wait_on("default")

    async def scenario() -> list[int]:
        async with await psycopg.AsyncConnection.connect(database_url) as aconn:
            return await app.enqueue_many_async(aconn, [send.job(n=n) for n in range(5)])

    ids = asyncio.run(scenario())

    assert len(ids) == 5
    assert listener.collect() == ["default"]
    assert count_jobs(database_url) == 5


def test_enqueue_many_of_nothing_writes_and_sends_nothing(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    with psycopg.connect(database_url) as conn:
        assert app.enqueue_many(conn, []) == []
        assert conn.info.transaction_status == TransactionStatus.IDLE

    assert listener.collect() == []


# -- bad input: refused with the argument named, nothing sent --------------------------


class Customer:
    pass


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"value": Customer()}, "argument 'value' is a Customer"),
        ({"value": {1, 2}}, "argument 'value' is a set"),
        ({"value": datetime(2030, 1, 1, tzinfo=UTC)}, "argument 'value' is a datetime"),
        ({"value": math.nan}, "argument 'value' is nan"),
        ({"value": math.inf}, "argument 'value' is inf"),
        ({"value": [1.0, -math.inf]}, r"argument 'value'\[1\] is -inf"),
        ({"value": "a\x00b"}, "argument 'value' contains a NUL character"),
        ({"value": {"k": "\udcff"}}, r"argument 'value'\['k'\] contains a lone surrogate"),
        ({}, "missing a required argument: 'value'"),
        ({"value": 1, "other": 2}, "unexpected keyword argument 'other'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(
    app: skiplock.App, conn: psycopg.Connection[Any], args: dict[str, Any], message: str
) -> None:
    task = app.task(name="store")(lambda value: None)

    with pytest.raises(skiplock.EnqueueError, match=message) as caught:
        task.enqueue(conn, **args)

    assert "cannot enqueue store" in str(caught.value)
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert conn.execute("SELECT count(*) FROM skiplock.jobs").fetchone() == (0,)


def test_one_bad_job_in_a_batch_is_refused_when_built(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    task = app.task(name="store")(lambda value: None)

    with pytest.raises(skiplock.EnqueueError, match="argument 'value' is a set"):
        app.enqueue_many(conn, [task.job(value=1), task.job(value={2})])

    assert conn.info.transaction_status == TransactionStatus.IDLE


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queue": "no spaces"}, "queue name"),
        ({"priority": 1 << 20}, "priority must be between"),
        ({"priority": "high"}, "priority must be an integer"),
        ({"run_at": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"max_attemps": 2}, "did you mean 'max_attempts'"),
    ],
)
def test_bad_per_call_options_are_refused(
    app: skiplock.App, conn: psycopg.Connection[Any], options: dict[str, Any], message: str
) -> None:
    task = app.task(name="store")(lambda value: None)

    with pytest.raises(skiplock.ConfigurationError, match=message):
        task.with_options(**options).enqueue(conn, value=1)

    assert conn.info.transaction_status == TransactionStatus.IDLE


# Strings PostgreSQL's jsonb can hold: no NUL, no lone surrogates.
storable_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"))
# Floats whose shortest repr has no exponent: see the large-float test below.
storable_floats = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e15, max_value=1e15)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | storable_floats | storable_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(storable_text, children, max_size=4)
    ),
    max_leaves=25,
)


# Enqueue only needs the schema name; this app never connects by itself.
roundtrip_app = skiplock.App(schema="skiplock")
store = roundtrip_app.task(name="store")(lambda value: None)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values)
def test_any_json_value_comes_back_equal_from_the_args_column(
    conn: psycopg.Connection[Any], value: object
) -> None:
    with conn.transaction(force_rollback=True):
        job_id = store.enqueue(conn, value=value)
        row = conn.execute("SELECT args FROM skiplock.jobs WHERE id = %s", (job_id,)).fetchone()

    assert row == ({"value": value},)


def test_large_floats_come_back_as_the_same_floats(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    task = app.task(name="store")(lambda value: None)
    values = [1e16, 1e23, -2.5e300]

    job_id = task.enqueue(conn, value=values)

    row = conn.execute("SELECT args FROM skiplock.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None
    stored = row[0]["value"]
    assert stored == values
    assert all(isinstance(v, float) for v in stored)


def test_an_int_too_long_to_encode_is_refused_naming_the_argument(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    task = app.task(name="store")(lambda value: None)

    with pytest.raises(skiplock.EnqueueError, match="argument 'value'"):
        task.enqueue(conn, value=10**5000)


@pytest.mark.parametrize("name", ["conn", "self"])
def test_a_handler_argument_may_be_called_conn_or_self(
    app: skiplock.App, conn: psycopg.Connection[Any], name: str
) -> None:
    def handler(**kwargs: Any) -> None: ...

    task = app.task(name="handler")(handler)

    task.enqueue(conn, **{name: "value"})

    assert conn.execute("SELECT args FROM skiplock.jobs").fetchone() == ({name: "value"},)
