"""The leader's duties under a user's lock: a statement that waits too long for a lock
ends what it was doing for that one item, and the rest of the pass goes on."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

import skiplock
from skiplock.periodic import enqueue_due

from .conftest import Ops

pytestmark = pytest.mark.server_version

FIRST_SEEN = datetime(2025, 6, 1, 12, 0, 30, tzinfo=UTC)
LOCK_TIMEOUT_MS = 200


async def cron_pass(app: skiplock.App, now: datetime) -> int:
    """One cron pass as the leader runs it: on a connection whose lock waits are bounded
    (worker/timeouts.py; shorter here, to keep the test quick)."""
    async with await psycopg.AsyncConnection.connect(
        app.database_url, autocommit=True, options=f"-c lock_timeout={LOCK_TIMEOUT_MS}"
    ) as conn:
        return await enqueue_due(conn, app, now)


@pytest.mark.timeout(60)
def test_a_schedule_whose_unique_key_is_held_waits_alone(ops: Ops) -> None:
    """An application transaction holds the unique key of one schedule's job (it enqueued
    the same job and has not committed). The cron pass gives up on that schedule when its
    lock wait times out, enqueues the other schedule's tick all the same, and the held
    one's tick is enqueued by the first pass after the transaction ends."""
    app = skiplock.App(ops.url, schema=ops.schema)

    @app.periodic("*/5 * * * *", name="held", unique=True)
    def held() -> None:
        return None

    @app.periodic("*/5 * * * *", name="free")
    def free() -> None:
        return None

    assert list(app.periodics) == ["held", "free"]  # the held one first
    assert asyncio.run(cron_pass(app, FIRST_SEEN)) == 0  # first sight: both start counting
    due = FIRST_SEEN + timedelta(minutes=5)

    with psycopg.connect(ops.url) as app_tx:
        held.enqueue(app_tx)  # not committed: its unique key is held
        assert asyncio.run(cron_pass(app, due)) == 1
        assert ops.rows("SELECT task FROM {jobs}") == [("free",)]
        app_tx.rollback()

    assert asyncio.run(cron_pass(app, due)) == 1
    assert sorted(ops.rows("SELECT task FROM {jobs}")) == [("free",), ("held",)]
