"""The job: fulfil a placed order. A worker runs it: ``skiplock worker orders.tasks:app``."""

from __future__ import annotations

import asyncio
import os

import skiplock

# The database is SKIPLOCK_DATABASE_URL; the schema one of its own (SKIPLOCK_SCHEMA
# overrides it), so that the tutorial's and the other examples' jobs on the same server
# are never this worker's.
app = skiplock.App(schema=os.environ.get("SKIPLOCK_SCHEMA") or "fastapi_orders")


@app.task(queue="orders", max_attempts=5)
async def fulfil_order(order_id: int, item: str, quantity: int) -> dict[str, str | int]:
    """Ask the warehouse to ship the order; the receipt is the job's result."""
    await asyncio.sleep(0.1)  # stands for the warehouse's API
    return {"order_id": order_id, "receipt": f"R-{order_id:06d}", "shipped": f"{quantity} x {item}"}
