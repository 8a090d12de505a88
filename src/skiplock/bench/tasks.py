"""The app the bench's worker processes run (``skiplock worker skiplock.bench:app``) and its
tasks: a no-op, a short pause, and a probe that returns when it started."""

from __future__ import annotations

import asyncio
import os
import time

from skiplock import durable as skiplock_durable
from skiplock.app import App
from skiplock.config import SCHEMA_ENV

# The scratch schema every scenario works in, dropped and rebuilt for each run.
BENCH_SCHEMA = "skiplock_bench"

app = App(schema=os.environ.get(SCHEMA_ENV, BENCH_SCHEMA))


@app.task(name="bench.noop")
async def noop() -> None:
    return None


@app.task(name="bench.pause")
async def pause(ms: int) -> None:
    """A short job: the failover scenario's drain must still run when the primary goes."""
    await asyncio.sleep(ms / 1000)


@app.task(name="bench.probe")
async def probe() -> float:
    """Returns when it started, so latency is computed from the stored result."""
    return time.time()


# Steps per job of the steps scenario (bench/steps.py).
STEPS = 10


def _nothing() -> None:
    return None


@app.task(name="bench.stepped")
async def stepped() -> None:
    """STEPS durable steps that do nothing: what recording them costs."""
    for n in range(STEPS):
        await skiplock_durable.step_async(f"s{n}", _nothing)


@app.task(name="bench.stepped_sync")
def stepped_sync() -> None:
    """The same from a sync handler's thread (each record goes through the event loop)."""
    for n in range(STEPS):
        skiplock_durable.step(f"s{n}", _nothing)
