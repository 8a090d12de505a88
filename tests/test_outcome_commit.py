"""A flush of outcomes all of one kind is one statement that commits alone
(sql/complete.py, _committing_alone): it must stay as durable, as fenced and as loud (one
wake-up of result waiters per flush) as the transaction of five statements it replaces."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import skiplock
from conftest import SCHEMA, Listener
from skiplock.completer import Completer, fenced_batch
from skiplock.config import done_channel
from skiplock.outcomes import Completed, Snoozed
from skiplock.sql import complete, render

pytestmark = pytest.mark.server_version

ALONE: dict[str, tuple[str, dict[str, Any]]] = {
    "completed": (complete.JOB_COMPLETE_MANY_ALONE, {"result": '"done"'}),
    "failed": (
        complete.JOB_FAIL_MANY_ALONE,
        {"dead": False, "delay": 0.0, "error": {"type": "Boom", "attempt": 1}},
    ),
    "snoozed": (complete.JOB_SNOOZE_MANY_ALONE, {"delay": 1.0}),
    "cancelled": (complete.JOB_CANCEL_MANY_ALONE, {}),
}


def running(conn: psycopg.Connection[Any], worker: uuid.UUID, count: int) -> list[int]:
    rows = conn.execute(
        "INSERT INTO skiplock.jobs (task, state, attempts, worker_id, lease_expires_at) "
        "SELECT 't', 'running', 1, %s, now() + interval '1 hour' "
        "FROM generate_series(1, %s) RETURNING id",
        (worker, count),
    ).fetchall()
    return sorted(int(r[0]) for r in rows)


@pytest.fixture
def done_listener(database_url: str) -> Any:
    listening = Listener(database_url, done_channel(SCHEMA))
    yield listening
    listening.close()


@pytest.mark.parametrize("group", sorted(ALONE))
@pytest.mark.parametrize("fenced_out", [False, True])
def test_a_write_alone_commits_durably_and_wakes_result_waiters_once(
    app: skiplock.App, database_url: str, done_listener: Listener, group: str, fenced_out: bool
) -> None:
    """Run in a transaction of a session with synchronous_commit off, as a worker's: the
    statement turns it on until its transaction ends, and notifies once, even when the
    fence refuses every row (nothing written, as a flush of stale outcomes)."""
    worker = uuid.uuid4()
    statement, extra = ALONE[group]
    with psycopg.connect(database_url, options="-c synchronous_commit=off") as conn:
        ids = running(conn, worker, 3)
        conn.commit()
        entries = {job_id: {"attempt": 1, "progress": None, **extra} for job_id in ids}
        params = {
            **fenced_batch(entries),
            "worker_id": uuid.uuid4() if fenced_out else worker,
            "channel": done_channel(SCHEMA),
        }
        written = conn.execute(render(statement, SCHEMA), params).fetchall()
        setting = conn.execute("SELECT current_setting('synchronous_commit')").fetchone()
        conn.commit()
        after = conn.execute("SELECT current_setting('synchronous_commit')").fetchone()
        states = conn.execute(
            "SELECT id, state FROM skiplock.jobs WHERE id = ANY(%s)", (ids,)
        ).fetchall()
        conn.commit()
    assert setting == ("on",)
    assert after == ("off",), "only the statement's own transaction"
    assert sorted(written) == ([] if fenced_out else [(job_id,) for job_id in ids])
    assert done_listener.collect() == [""]
    if fenced_out:
        assert sorted(states) == [(job_id, "running") for job_id in ids]
    else:
        gone = group in ("completed", "cancelled")
        assert len(states) == (0 if gone else 3)


def test_a_flush_of_one_kind_and_one_of_two_kinds_write_the_same(
    app: skiplock.App, conn: psycopg.Connection[Any], database_url: str, done_listener: Listener
) -> None:
    """Outcomes of one kind take the statement alone, of several the transaction: the same
    rows are written, stale ones refused, and each flush wakes result waiters once."""
    worker = uuid.uuid4()
    ids = running(conn, worker, 6)
    conn.commit()

    async def flushes() -> Completer:
        async with AsyncConnectionPool(
            database_url, min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
        ) as pool:
            completer = Completer(pool, SCHEMA, worker, interval=0.0)
            completer.add(Completed(ids[0], 1, result_json='{"n": 1}'))
            completer.add(Completed(ids[1], 2, result_json='{"n": 2}'))  # a stale attempt
            await completer.flush()
            completer.add(Completed(ids[2], 1, result_json='{"n": 3}'))
            completer.add(Snoozed(ids[3], 1, delay=0.0))
            completer.add(Snoozed(ids[4], 7, delay=0.0))  # a stale attempt
            await completer.flush()
            return completer

    completer = asyncio.run(flushes())
    assert completer.stats.completed == 2
    assert completer.stats.snoozed == 1
    assert sorted(completer.refused_ids) == [ids[1], ids[4]]
    assert completer.stats.flushes == 2
    history = conn.execute("SELECT id, result FROM skiplock.job_history ORDER BY id").fetchall()
    assert history == [(ids[0], {"n": 1}), (ids[2], {"n": 3})]
    states = dict(conn.execute("SELECT id, state FROM skiplock.jobs").fetchall())
    assert states == {
        ids[1]: "running",
        ids[3]: "available",
        ids[4]: "running",
        ids[5]: "running",
    }
    assert done_listener.collect() == ["", ""]
