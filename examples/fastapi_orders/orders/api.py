"""The HTTP API: POST /orders writes the order and enqueues its job in one transaction;
GET /orders/{id} reports the order with its job's state and result.

Run it with ``uvicorn orders.api:api`` beside ``skiplock worker orders.tasks:app``, or
both at once with ``python -m orders``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from skiplock import JobNotFoundError
from skiplock.contrib.sqlalchemy import enqueue_async, get_job_async
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from orders.database import Item, Order, create_tables, make_engine
from orders.tasks import app, fulfil_order


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    engine = make_engine(app.database_url)
    await create_tables(engine)
    api.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
    yield
    await engine.dispose()


api = FastAPI(title="orders", lifespan=lifespan)


async def session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessions() as opened:
        yield opened


Session = Annotated[AsyncSession, Depends(session)]


class NewOrder(BaseModel):
    item: str
    quantity: int = Field(gt=0)


@api.post("/orders", status_code=201)
async def place_order(order: NewOrder, session: Session) -> dict[str, int]:
    """The order, its job and the stock it takes: all three commit, or none does."""
    try:
        async with session.begin():
            placed = Order(item=order.item, quantity=order.quantity)
            session.add(placed)
            await session.flush()  # gives the order its id
            placed.job_id = await enqueue_async(
                session, fulfil_order, order_id=placed.id, item=order.item, quantity=order.quantity
            )
            taken = await session.execute(
                update(Item)
                .where(Item.name == order.item)
                .values(stock=Item.stock - order.quantity)
            )
            if taken.rowcount == 0:  # type: ignore[attr-defined]
                raise HTTPException(404, f"we do not sell {order.item!r}")
    except IntegrityError:  # items_in_stock: the stock would go below zero
        raise HTTPException(409, f"not enough {order.item!r} in stock") from None
    return {"id": placed.id, "job_id": placed.job_id}


@api.get("/orders/{order_id}")
async def show_order(order_id: int, session: Session) -> dict[str, Any]:
    placed = await session.get(Order, order_id)
    if placed is None or placed.job_id is None:
        raise HTTPException(404, f"no order {order_id}")
    try:
        job = await get_job_async(session, placed.job_id, app=app)
    except JobNotFoundError:  # finished long ago: history was pruned
        status: dict[str, Any] | None = None
    else:
        status = {
            "id": job.id,
            "state": str(job.state),
            "attempts": job.attempts,
            "result": job.result,
            "last_error": job.last_error,
        }
    return {"id": placed.id, "item": placed.item, "quantity": placed.quantity, "job": status}
