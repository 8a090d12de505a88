"""The service's own tables, in the same database as skiplock's: one transaction can
write an order and its job."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import CheckConstraint, String, func
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

STOCK = {"book": 100, "lamp": 3}


class Base(DeclarativeBase):
    pass


class Item(Base):
    __tablename__ = "items"
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    stock: Mapped[int] = mapped_column(CheckConstraint("stock >= 0", name="items_in_stock"))


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(100))
    quantity: Mapped[int]
    job_id: Mapped[int | None]
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


def make_engine(database_url: str) -> AsyncEngine:
    """An async engine on psycopg 3 (the driver skiplock enqueues through). Connections
    are made from skiplock's URL as it is, whether a URL or a key=value string."""

    async def connect() -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(database_url)

    return create_async_engine("postgresql+psycopg://", async_creator=connect)


async def create_tables(engine: AsyncEngine) -> None:
    """The tables, and some stock (for a real service: migrations, e.g. Alembic)."""
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        rows = [{"name": name, "stock": stock} for name, stock in STOCK.items()]
        await conn.execute(insert(Item).values(rows).on_conflict_do_nothing())
