"""wait_event: the waits of the worker's loops must never swallow a cancellation."""

from __future__ import annotations

import asyncio

from skiplock.waiting import wait_event


async def _loop_until_cancelled(wake: asyncio.Event) -> None:
    while True:
        await wait_event(wake, 5.0)
        wake.clear()


def test_a_cancellation_that_lands_with_the_wake_up_stops_the_loop() -> None:
    """The event is set in the same loop step as the waiting task is cancelled: how an
    'admit' notification meets shutdown. asyncio.wait_for drops that cancellation on
    Python 3.10 and 3.11 (gh-86296) and the loop runs on; wait_event must not."""

    async def scenario() -> bool:
        wake = asyncio.Event()
        task = asyncio.create_task(_loop_until_cancelled(wake))
        await asyncio.sleep(0.01)
        wake.set()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        if not done:
            task.cancel()
        return bool(done) and task.cancelled()

    assert asyncio.run(scenario())


def test_wait_event_reports_whether_the_event_came() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        event = asyncio.Event()
        timed_out = await wait_event(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        arrived = await wait_event(event, 5.0)
        already = await wait_event(event, 0.0)
        return timed_out, arrived, already

    assert asyncio.run(scenario()) == (False, True, True)
