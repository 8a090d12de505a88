"""Shutdown never hangs on a cancellation that was swallowed.

On Python 3.11, ``asyncio.wait_for`` returns the awaited result instead of raising when a
task is cancelled in the same loop step as that result arrives (CPython gh-86296, fixed in
3.12). psycopg_pool waits for a free connection that way, so a service cancelled just as
the pool hands it a connection carries on as if never cancelled. A stop that cancels once
and waits then waits for ever: the cause of the graceful-stop test that hung for 60 s
(issue 10, item 22), found in a dump of the worker's tasks (promoter 'cancelling', still
looping). The supervisor repeats the cancellation until the service has ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

from psycopg_pool import AsyncConnectionPool

from skiplock.worker.supervisor import Supervisor


class PoolUser:
    """A service that takes the pool's one connection over and over, as the leader's
    duties and the promoter do."""

    name = "pool-user"

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self.pool = pool
        self.passes = 0
        self.waiting = asyncio.Event()

    async def run(self) -> None:
        while True:
            self.waiting.set()
            async with self.pool.connection() as conn:
                await conn.execute("SELECT 1")
            self.passes += 1
            await asyncio.sleep(0.005)


async def _stop_during_hand_over(database_url: str) -> tuple[bool, int]:
    async with AsyncConnectionPool(database_url, min_size=1, max_size=1, open=False) as pool:
        await pool.open(wait=True)
        supervisor = Supervisor()
        service = PoolUser(pool)
        async with pool.connection():
            supervisor.start(service)
            await service.waiting.wait()
            await asyncio.sleep(0.05)  # the service now waits for the only connection
        # Leaving the block handed the connection to the waiting service; it has not run
        # yet. Stopping now is the moment a single cancel() is lost on Python 3.11.
        stopping = asyncio.ensure_future(supervisor.stop())
        done, _ = await asyncio.wait({stopping}, timeout=5.0)
        if not done:
            stopping.cancel()
        return bool(done), service.passes


def test_stop_ends_a_service_whose_cancellation_was_swallowed(database_url: str) -> None:
    stopped, _ = asyncio.run(_stop_during_hand_over(database_url))
    assert stopped, "the supervisor's stop waited for ever on a service that lost its cancel"
