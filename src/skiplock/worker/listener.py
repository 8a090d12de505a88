"""One LISTEN connection per worker process, one of the sessions holding its liveness lock.

Notifications only wake producers (and carry control messages).

Correctness never depends on a notification arriving: jobs live in the table and
producers poll. A notification that is missed (listener reconnecting, process busy) only
delays a job until the next poll.

Nor does it depend on what a notification says: any role that can connect can NOTIFY on
our channels. Each payload is parsed (control.py); a malformed one is logged, at most one
line per channel every THROTTLE_SECONDS, and ignored, and whatever a handler raises is
logged and ignored too. Nothing that arrives can end this service: its connection holds
the liveness lock, and losing that makes the leader rescue every running job here.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from skiplock.control import (
    ControlMessage,
    Throttle,
    Wakeup,
    describe_payload,
    parse_control,
    parse_wakeup,
)
from skiplock.retry import RetryPolicy

log = logging.getLogger("skiplock.worker.listener")

RECONNECT = RetryPolicy(base=0.1, factor=2.0, cap=5.0, jitter=0.5)
# At most one line per channel this often about malformed payloads (and as often about
# failing handlers): a flood must not flood the log.
THROTTLE_SECONDS = 10.0


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
        control: tuple[str, Callable[[ControlMessage], None]] | None = None,
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
        # Payloads ignored as malformed, and handler calls that raised, since the start.
        self.malformed = 0
        self.handler_failures = 0
        self._throttle = Throttle(THROTTLE_SECONDS)

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
                            self.dispatch(note.channel, note.payload)
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

    def dispatch(self, channel: str, payload: str) -> None:
        """Parse one notification and hand it on. Never raises: a malformed payload and
        a handler that fails are logged (throttled) and ignored."""
        try:
            if channel == self._channel:
                wakeup = parse_wakeup(payload)
                if wakeup is not None:
                    self._on_wakeup(wakeup)
                    return
            elif self._control is not None and channel == self._control[0]:
                message = parse_control(payload)
                if message is not None:
                    self._control[1](message)
                    return
            else:
                return  # not LISTENed to here
        except Exception:
            self.handler_failures += 1
            self._complain(
                f"{channel} handler",
                logging.ERROR,
                f"handling {describe_payload(payload)} from {channel} failed; ignored",
                exc_info=True,
            )
            return
        self.malformed += 1
        self._complain(
            channel,
            logging.WARNING,
            f"ignored a malformed notification on {channel}: {describe_payload(payload)}",
        )

    def _complain(self, key: str, level: int, text: str, *, exc_info: bool = False) -> None:
        held = self._throttle.allow(key, asyncio.get_running_loop().time())
        if held is None:
            return
        if held:
            text += f" (and {held} more since the last such line)"
        log.log(level, "%s", text, exc_info=exc_info)
