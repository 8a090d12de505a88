"""Values of rows written by anyone, loaded so that every one of them can be shown.

The tables' constraints allow what Python cannot load: JSON nested deeper than Python's
recursion limit or holding a number longer than its 4,300-digit limit, and timestamps
outside Python's years 1 to 9999 (``infinity``, ``-infinity``, year 294276, 4713 BC).
psycopg refuses such a value, and with it the whole page that read it. On the
dashboard's connections (``register``) they load instead as ``RawJson`` (the JSON text
as stored) and ``FarTime`` (a datetime at Python's bound that shows as PostgreSQL wrote
it): the row is shown, what cannot be parsed as its text.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.datetime import TimestamptzLoader
from psycopg.types.json import JsonbLoader, JsonLoader


class RawJson(str):
    """JSON text Python could not load; the pages show it as stored."""


class FarTime(datetime):
    """A timestamptz Python cannot hold. It compares as Python's last (or first) moment,
    so that sorting and comparing keep working, and ``text`` is what PostgreSQL wrote."""

    text: str

    @classmethod
    def of(cls, text: str) -> FarTime:
        early = text.startswith("-") or text.endswith(" BC")
        bound = datetime.min if early else datetime.max
        moment = cls(
            bound.year,
            bound.month,
            bound.day,
            bound.hour,
            bound.minute,
            bound.second,
            bound.microsecond,
            tzinfo=UTC,
        )
        moment.text = text
        return moment


def _text(data: Any) -> str:
    return bytes(data).decode("utf-8", errors="replace")


class _TolerantJsonbLoader(JsonbLoader):
    def load(self, data: Any) -> Any:
        try:
            return super().load(data)
        except (RecursionError, ValueError):
            return RawJson(_text(data))


class _TolerantJsonLoader(JsonLoader):
    def load(self, data: Any) -> Any:
        try:
            return super().load(data)
        except (RecursionError, ValueError):
            return RawJson(_text(data))


class _TolerantTimestamptzLoader(TimestamptzLoader):
    def load(self, data: Any) -> datetime:
        try:
            return super().load(data)
        except psycopg.DataError:
            return FarTime.of(_text(data))


def register(conn: psycopg.Connection[Any]) -> None:
    """Load JSON and timestamptz values on ``conn`` tolerantly (text format, which the
    dashboard's statements use)."""
    conn.adapters.register_loader("jsonb", _TolerantJsonbLoader)
    conn.adapters.register_loader("json", _TolerantJsonLoader)
    conn.adapters.register_loader("timestamptz", _TolerantTimestamptzLoader)
