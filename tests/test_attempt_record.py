"""What a job keeps of its attempts for reports (migration 0016): the first start, every
worker that claimed it, and the module of each failure's exception."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

import skiplock
from conftest import StartWorker, wait_until
from skiplock import client

pytestmark = pytest.mark.server_version

# Long enough for the first worker to stop before the retry comes due.
ONE_SECOND = skiplock.RetryPolicy(base=1.0, cap=1.0, jitter=0.0)


def history_row(url: str, job_id: int) -> dict[str, Any] | None:
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        return conn.execute(
            sql.SQL("SELECT * FROM {} WHERE id = %s").format(
                sql.Identifier("skiplock", "job_history")
            ),
            (job_id,),
        ).fetchone()


class CardDeclinedError(Exception):
    pass


def test_first_start_and_each_claiming_worker_reach_history(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    calls: list[int] = []

    @app.task(name="flaky", retry=ONE_SECOND)
    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise CardDeclinedError("declined")

    with app.connect() as conn:
        job_id = flaky.enqueue(conn)
        conn.commit()
    first = start_worker(app, poll_interval=0.05)
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        wait_until(
            lambda: client.get_job(conn, app.schema, job_id).state == "retryable",
            10.0,
            "the first attempt to fail",
        )
    first.stop()
    second = start_worker(app, poll_interval=0.05)
    wait_until(lambda: history_row(app.database_url, job_id), 10.0, "the job to complete")
    second.stop()

    row = history_row(app.database_url, job_id)
    assert row is not None
    assert row["worker_ids"] == [first.worker.id, second.worker.id]
    [error] = row["errors"]
    assert (error["module"], error["type"]) == (__name__, "CardDeclinedError")
    # The first attempt's start, not the last one's.
    assert row["started_at"] < row["attempted_at"]
    assert row["created_at"] <= row["started_at"]
