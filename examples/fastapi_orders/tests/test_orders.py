"""Placing an order writes it and its job together; a worker (or drain, in-process)
fulfils it; GET shows the job's state and result."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import httpx
import psycopg
import skiplock
from skiplock.testing import assert_enqueued, drain, perform_job, refute_enqueued

from orders.tasks import fulfil_order

Conn = psycopg.Connection[Any]


def place(client: httpx.Client, item: str, quantity: int) -> dict[str, Any]:
    response = client.post("/orders", json={"item": item, "quantity": quantity})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def test_an_order_and_its_job_are_committed_together(
    client: httpx.Client, skiplock_conn: Conn
) -> None:
    order = place(client, "book", 2)

    job = assert_enqueued(
        skiplock_conn, fulfil_order, args={"order_id": order["id"], "item": "book", "quantity": 2}
    )
    assert job.id == order["job_id"]
    assert client.get(f"/orders/{order['id']}").json()["job"]["state"] == "available"


def test_an_order_out_of_stock_leaves_no_job(client: httpx.Client, skiplock_conn: Conn) -> None:
    response = client.post("/orders", json={"item": "lamp", "quantity": 1000})

    assert response.status_code == 409
    assert response.json() == {"detail": "not enough 'lamp' in stock"}
    # The job was enqueued before the stock ran out: it rolled back with the order.
    refute_enqueued(skiplock_conn, fulfil_order, args={"item": "lamp", "quantity": 1000})


def test_an_unknown_item_or_order_is_not_found(client: httpx.Client) -> None:
    assert client.post("/orders", json={"item": "sofa", "quantity": 1}).status_code == 404
    assert client.get("/orders/999999").status_code == 404
    assert client.post("/orders", json={"item": "book", "quantity": 0}).status_code == 422


def test_the_job_returns_the_receipt() -> None:
    outcome = perform_job(fulfil_order, order_id=7, item="book", quantity=1)

    assert outcome.result == {"order_id": 7, "receipt": "R-000007", "shipped": "1 x book"}


def test_drain_fulfils_placed_orders_in_process(
    client: httpx.Client, skiplock_app: skiplock.App
) -> None:
    order = place(client, "book", 1)

    # The service committed the job on its own connection: drain on one whose transaction
    # starts now (the test's began before the job was committed, so to it the job is not
    # due yet). The outcomes commit, as the service's order did.
    with psycopg.connect(skiplock_app.database_url, autocommit=True) as conn:
        outcomes = drain(conn, skiplock_app, queues=["orders"])

    mine = [o for o in outcomes if o.job_id == order["job_id"]]
    assert [o.kind for o in mine] == ["completed"]
    assert mine[0].result["receipt"] == f"R-{order['id']:06d}"


def test_a_worker_process_fulfils_the_order(
    client: httpx.Client, worker: subprocess.Popen[bytes]
) -> None:
    order = place(client, "book", 3)

    deadline = time.monotonic() + 30
    while (job := client.get(f"/orders/{order['id']}").json()["job"])["state"] != "completed":
        assert worker.poll() is None, "the worker exited"
        assert time.monotonic() < deadline, f"not fulfilled in 30 s: {job}"
        time.sleep(0.1)

    assert job == {
        "id": order["job_id"],
        "state": "completed",
        "attempts": 1,
        "result": {
            "order_id": order["id"],
            "receipt": f"R-{order['id']:06d}",
            "shipped": "3 x book",
        },
        "last_error": None,
    }
