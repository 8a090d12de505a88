"""The tasks the test-helper tests run: a small shop whose handlers report what they saw.

Its App has no database of its own: the ``skiplock_app`` fixture (conftest.py) points it
at the run's database and the plugin's throwaway schema, as a user's conftest would.
"""

from __future__ import annotations

from typing import Any

import psycopg

import skiplock

app = skiplock.App(schema="skiplock")

ORDERS_TABLE = """
CREATE TABLE shop_orders (id int PRIMARY KEY, paid boolean NOT NULL DEFAULT false,
                          shipped boolean NOT NULL DEFAULT false)
"""


@app.task(name="shop.send_receipt", queue="emails")
def send_receipt(order_id: int, email: str = "buyer@example.com") -> dict[str, Any]:
    job = skiplock.current_job()
    return {"order_id": order_id, "to": email, "job": job.id, "attempt": job.attempts}


@app.task(name="shop.notify_warehouse")
async def notify_warehouse(order_id: int, items: list[str]) -> list[str]:
    skiplock.set_progress({"notified": len(items)})
    return [f"{order_id}:{item}" for item in items]


@app.task(name="shop.charge_card", max_attempts=2)
def charge_card(order_id: int, amount: float) -> None:
    raise RuntimeError(f"card declined for order {order_id}")


@app.task(name="shop.call_back_later")
def call_back_later(order_id: int) -> None:
    raise skiplock.Retry(after=30)


@app.task(name="shop.not_yet")
def not_yet(order_id: int) -> None:
    raise skiplock.Snooze(60)


@app.task(name="shop.odd_result")
def odd_result() -> set[int]:
    return {1, 2}


@app.task(name="shop.mark_paid", transactional=True)
def mark_paid(conn: psycopg.Connection[Any], order_id: int) -> int:
    """Pays the order and sends the receipt, both in the job's own transaction."""
    row = conn.execute(
        "UPDATE shop_orders SET paid = true WHERE id = %s RETURNING id", (order_id,)
    ).fetchone()
    if row is None:
        raise LookupError(f"no order {order_id}")
    send_receipt.enqueue(conn, order_id=order_id)
    return order_id


@app.task(name="shop.mark_shipped", transactional=True)
async def mark_shipped(conn: psycopg.AsyncConnection[Any], order_id: int) -> bool:
    cur = await conn.execute(
        "UPDATE shop_orders SET shipped = true WHERE id = %s RETURNING id", (order_id,)
    )
    return await cur.fetchone() is not None


@app.task(name="shop.pay_then_fail", transactional=True)
def pay_then_fail(conn: psycopg.Connection[Any], order_id: int) -> None:
    conn.execute("UPDATE shop_orders SET paid = true WHERE id = %s", (order_id,))
    raise RuntimeError("the payment service hung up")
