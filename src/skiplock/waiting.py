"""Waiting for an event with a timeout, without losing a cancellation.

``asyncio.wait_for(event.wait(), timeout)`` on Python 3.10 and 3.11 can swallow the
cancellation of the task awaiting it when the event is set in the same loop step (CPython
gh-86296, fixed in 3.12). A loop that waits that way runs on after shutdown cancelled it,
and the worker never stops. ``asyncio.wait`` does not swallow the cancellation.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """True once ``event`` is set, False when ``timeout`` seconds passed first."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=max(timeout, 0.0))
    finally:
        waiter.cancel()
    return bool(done)
