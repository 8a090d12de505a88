"""One LISTEN connection per worker process. Notifications only wake producers.

Correctness never depends on a notification arriving: jobs live in the table and
producers poll. A notification that is missed (listener reconnecting, process busy) only
delays a job until the next poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql

from skiplock.retry import RetryPolicy

log = logging.getLogger("skiplock.notifier")

RECONNECT = RetryPolicy(base=0.1, factor=2.0, cap=5.0, jitter=0.5)


class Notifier:
    """Sets the wake event of each queue named in a notification on ``channel``."""

    def __init__(
        self,
        database_url: str,
        channel: str,
        wake: Mapping[str, asyncio.Event],
        *,
        setup: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        self._url = database_url
        self._channel = channel
        self._wake = wake
        self._setup = setup
        self.connected = asyncio.Event()
        self.reconnects = 0

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with back-off when the connection drops."""
        import random  # noqa: PLC0415

        rng = random.Random()
        failures = 0
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True
                ) as conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    if self._setup is not None:
                        # e.g. the worker's liveness lock: held exactly as long as this
                        # connection lives, so it must be taken on it after each reconnect.
                        await conn.execute(*self._setup)
                    failures = 0
                    self.connected.set()
                    # Anything sent while we were away was lost: poll every queue now.
                    for event in self._wake.values():
                        event.set()
                    async for note in conn.notifies():
                        woken = self._wake.get(note.payload)
                        if woken is not None:
                            woken.set()
            except psycopg.OperationalError as exc:
                self.connected.clear()
                failures += 1
                self.reconnects += 1
                delay = RECONNECT.delay(failures, rng)
                log.warning("listener connection lost (%s); reconnecting in %.2fs", exc, delay)
                await asyncio.sleep(delay)
