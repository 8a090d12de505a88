"""The services that move claim cursors back to jobs committed behind them.

A claim cursor (cursor.py) skips what its last claim passed; a job that commits behind it
is found by its notification, or, when none was sent, by one of these: ``LateCommits``
(wakeup.py) reads the jobs of transactions that were still open at its last snapshot,
every 20 ms; ``CursorProbe`` looks behind each cursor every few seconds, the last
safety net. Every worker runs both for its own cursors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from skiplock.cursor import ClaimCursor, Position
from skiplock.sql import claim, render
from skiplock.worker.supervisor import PeriodicService, describe

log = logging.getLogger("skiplock.worker")

Pool = AsyncConnectionPool[Any]
Source = TypeVar("Source")


class CursorWatch(PeriodicService, Generic[Source]):
    """A pass every ``every`` seconds over ``cursors`` (tasks in ``excluded`` are not
    this kind of claim's) that reads ``statement`` (rendered for ``schema``) through
    ``source``; ``found`` rewinds a cursor and wakes its queue's producers."""

    log = log
    statement: ClassVar[str]

    def __init__(
        self,
        source: Source,
        schema: str,
        cursors: dict[str, ClaimCursor],
        excluded: list[str],
        *,
        every: float,
        on_found: Callable[[str], None],
    ) -> None:
        self._source = source
        self._statement = render(self.statement, schema)
        self._cursors = cursors
        self._excluded = excluded
        self._every = every
        self._on_found = on_found

    def found(self, queue: str, position: Position) -> None:
        self._cursors[queue].rewind_to(position)
        self._on_found(queue)


class CursorProbe(CursorWatch[Pool]):
    """Every ``every`` seconds, look behind each queue's claim cursor for a ready job no
    notification announced, and rewind to it (off the claim path: see cursor.py)."""

    name = "probe"
    log = log
    statement = claim.JOB_BEHIND_CURSOR

    async def pause(self) -> None:
        await asyncio.sleep(self._every)

    async def run(self) -> None:
        await self.pause()  # claims have just swept: nothing to look for yet
        await super().run()

    async def run_once(self) -> None:
        for queue, cursor in self._cursors.items():
            position = cursor.position
            if position is None:
                continue
            try:
                async with self._source.connection() as conn:
                    cur = await conn.execute(
                        self._statement,
                        {
                            "queue": queue,
                            "exclude_tasks": self._excluded,
                            "after_priority": position[0],
                            "after_run_at": position[1],
                            "after_id": position[2],
                        },
                    )
                    found = await cur.fetchone()
            except psycopg.Error as exc:
                log.warning("cursor probe failed (%s); will retry", describe(exc))
                continue
            if found is not None:
                self.found(queue, (found[0], found[1], found[2]))
