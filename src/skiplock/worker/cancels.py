"""Cancel requests from the control channel, confirmed by the database before they act.

Anyone who can connect can NOTIFY ``cancel TAB id``. A request for a job this worker is
not running costs nothing; one for a job it runs is looked up first (JOB_CANCEL_CONFIRMED:
the row must carry cancel_requested_at, for this worker and the attempt it runs). The
requests that arrive while a lookup runs are confirmed together by the next one, so a
flood costs one query at a time. A request whose notification was missed, or whose
lookup failed, still reaches the job at its next heartbeat (JOB_EXTEND_LEASES_SKIP_LOCKED).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any
from uuid import UUID

import psycopg
from psycopg_pool import AsyncConnectionPool

from skiplock.completer import fenced_batch
from skiplock.sql import control, render
from skiplock.worker.supervisor import describe

log = logging.getLogger("skiplock.worker.cancels")


@dataclass(eq=False)
class CancelRequests:
    """``ask`` with a job id from a notification; ``cancel`` is called for each one the
    database confirms."""

    name = "cancels"

    pool: AsyncConnectionPool[Any]
    schema: InitVar[str]
    worker_id: UUID
    _: KW_ONLY
    attempt_of: Callable[[int], int | None]
    cancel: Callable[[int], None]
    _confirm: str = field(init=False)
    # Job id -> the attempt running here when asked.
    _asked: dict[int, int] = field(init=False, default_factory=dict)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    refused: int = field(init=False, default=0)  # requests the database did not confirm

    def __post_init__(self, schema: str) -> None:
        self._confirm = render(control.JOB_CANCEL_CONFIRMED, schema)

    def ask(self, job_id: int) -> None:
        attempt = self.attempt_of(job_id)
        if attempt is None:
            return  # not running here: nothing to stop
        self._asked[job_id] = attempt
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            asked, self._asked = self._asked, {}
            if not asked:
                continue
            try:
                confirmed = await self.confirm(asked)
            except psycopg.Error as exc:
                log.warning(
                    "confirming %d cancel requests failed (%s); heartbeats will carry them",
                    len(asked),
                    describe(exc),
                )
                continue
            self.refused += len(asked) - len(confirmed)
            for job_id in confirmed:
                self.cancel(job_id)

    async def confirm(self, asked: dict[int, int]) -> list[int]:
        """The ids among ``asked`` (id -> attempt) whose rows ask for their cancellation."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._confirm,
                {
                    **fenced_batch({job_id: {"attempt": a} for job_id, a in asked.items()}),
                    "worker_id": self.worker_id,
                },
            )
            return [int(row[0]) for row in await cur.fetchall()]
