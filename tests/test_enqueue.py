"""Enqueue is an ordinary insert in the caller's transaction."""

from __future__ import annotations

from typing import Any

import psycopg

import skiplock


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
