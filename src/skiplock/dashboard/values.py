"""Values of rows written by anyone, loaded so that every one of them can be shown.

The tables' constraints allow what Python cannot load: JSON nested deeper than Python's
recursion limit or holding a number longer than its 4,300-digit limit, and timestamps
outside Python's years 1 to 9999 (``infinity``, ``-infinity``, year 294276, 4713 BC).
psycopg refuses such a value, and with it the whole page that read it. The dashboard's
reads are repeated on such a failure with tolerant loaders (``read_tolerantly``), which
load them as ``RawJson`` (the JSON text as stored) and ``FarTime`` (a datetime at
Python's bound that shows as PostgreSQL wrote it): the row is shown, what cannot be
parsed as its text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from psycopg.pq import Format
from psycopg.types.datetime import TimestamptzLoader
from psycopg.types.json import JsonLoader

T = TypeVar("T")


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


class _TolerantJsonLoader(JsonLoader):
    """For json and jsonb alike: in text format psycopg loads both the same way (its
    JsonbLoader differs from JsonLoader only by name), from the JSON text."""

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


_TOLERANT: dict[str, type[JsonLoader | TimestamptzLoader]] = {
    "jsonb": _TolerantJsonLoader,
    "json": _TolerantJsonLoader,
    "timestamptz": _TolerantTimestamptzLoader,
}
# Errors of psycopg's own loaders on such values: DataError for a timestamp, RecursionError
# and ValueError (too many digits) for JSON.
LOAD_ERRORS = (psycopg.DataError, RecursionError, ValueError)


@contextmanager
def tolerant(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """JSON and timestamptz values load tolerantly on ``conn`` (text format, which the
    dashboard's statements use) until the block ends. psycopg's own loaders are C code
    (the tolerant ones cost about twice the time of a page of 100 rows), so a read uses
    them and is repeated in this block only when they fail (``read_tolerantly``)."""
    adapters = conn.adapters
    originals = {}
    for name, loader in _TOLERANT.items():
        info = adapters.types.get(name)
        if info is None:
            continue
        originals[info.oid] = adapters.get_loader(info.oid, Format.TEXT)
        adapters.register_loader(info.oid, loader)
    try:
        yield
    finally:
        for oid, original in originals.items():
            if original is not None:
                adapters.register_loader(oid, original)


def read_tolerantly(conn: psycopg.Connection[Any], work: Callable[[Any], T]) -> T:
    """``work(conn)``, and once more with tolerant loaders if a value failed to load."""
    try:
        return work(conn)
    except LOAD_ERRORS:
        with tolerant(conn):
            return work(conn)
