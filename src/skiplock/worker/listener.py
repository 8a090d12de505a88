"""One LISTEN connection per worker process, one of the sessions holding its liveness lock.

Notifications only wake producers (and carry control messages).

Correctness never depends on a notification arriving: jobs live in the table and
producers poll. A notification that is missed (listener reconnecting, process busy) only
delays a job until the next poll.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from skiplock.cursor import Wakeup, parse_payload
from skiplock.retry import RetryPolicy

log = logging.getLogger("skiplock.worker.listener")

RECONNECT = RetryPolicy(base=0.1, factor=2.0, cap=5.0, jitter=0.5)


class Listener:
    """Hands each notification on ``channel`` to ``on_wakeup``; ``on_connect`` runs after
    every (re)connection, since whatever was sent meanwhile is lost.

    ``connected`` is set exactly while the connection (and with it this session's share of
    the liveness lock) is up: producers wait on it. The worker's other sessions keep it
    alive meanwhile, so a dropped listener costs a pause in claims, not a rescue. A lost
    connection is reconnected here with back-off; anything else escapes to the
    supervisor, which restarts the service (``connected`` stays clear until then).
    """

    name = "listener"

    def __init__(
        self,
        database_url: str,
        channel: str,
        on_wakeup: Callable[[Wakeup], None],
        on_connect: Callable[[], None],
        *,
        setup: tuple[str, dict[str, Any]] | None = None,
        control: tuple[str, Callable[[str], None]] | None = None,
        connect_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._url = database_url
        self._connect_kwargs = connect_kwargs or {}
        self._channel = channel
        self._on_wakeup = on_wakeup
        self._on_connect = on_connect
        self._setup = setup
        self._control = control
        self.connected = asyncio.Event()
        self.reconnects = 0

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with back-off when the connection drops."""
        try:
            await self._listen()
        finally:
            self.connected.clear()

    async def _listen(self) -> None:
        rng = random.Random()
        failures = 0
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True, **self._connect_kwargs
                ) as conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    if self._control is not None:
                        await conn.execute(
                            sql.SQL("LISTEN {}").format(sql.Identifier(self._control[0]))
                        )
                    if self._setup is not None:
                        # e.g. the worker's share of its liveness lock (liveness.py): held
                        # as long as this connection lives, so taken after each reconnect.
                        await conn.execute(*self._setup)
                    failures = 0
                    self.connected.set()
                    try:
                        self._on_connect()
                        async for note in conn.notifies():
                            if self._control is not None and note.channel == self._control[0]:
                                self._control[1](note.payload)
                            else:
                                self._on_wakeup(parse_payload(note.payload))
                    finally:
                        # Before the connection (and the lock) goes: no claim after it.
                        self.connected.clear()
            except psycopg.OperationalError as exc:
                self.connected.clear()
                failures += 1
                self.reconnects += 1
                delay = RECONNECT.delay(failures, rng)
                log.warning("listener connection lost (%s); reconnecting in %.2fs", exc, delay)
                await asyncio.sleep(delay)
