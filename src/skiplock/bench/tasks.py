"""The app the bench's worker processes run (``skiplock worker skiplock.bench:app``) and its
tasks: a no-op, a short pause, and a probe that returns when it started."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg
from psycopg import sql

from skiplock import context as skiplock_context
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


@app.task(name="bench.waiter")
async def waiter() -> float:
    """Waits for the signal named by its job's id, and returns when it resumed: the
    signals scenario computes each signal's commit-to-resume time from it."""
    job_id = skiplock_context.current_job().id
    await skiplock_durable.wait_for_async(f"b:{job_id}")
    return time.time()


# The steps-chaos scenario's effects: one row per step call, with the worker process that
# made it, written on a connection of each worker process's own (made at its first effect).
EFFECT_STEPS = ("charge", "receipt", "webhook")
EFFECT_SECONDS = 0.05
_effects: list[psycopg.AsyncConnection[Any]] = []
_effects_made = asyncio.Lock()


async def _effect(job_id: int, step: str) -> str:
    async with _effects_made:
        if not _effects:
            _effects.append(
                await psycopg.AsyncConnection.connect(app.database_url, autocommit=True)
            )
    await _effects[0].execute(
        sql.SQL("INSERT INTO {} (job, step, pid) VALUES (%s, %s, %s)").format(
            sql.Identifier(app.schema, "bench_effects")
        ),
        (job_id, step, os.getpid()),
    )
    await asyncio.sleep(EFFECT_SECONDS)  # long enough for kills to land between steps
    return step


@app.task(name="bench.effectful", max_attempts=1000)
async def effectful() -> None:
    """Three durable steps, each with an effect counted in a table."""
    job_id = skiplock_context.current_job().id
    for step in EFFECT_STEPS:
        await skiplock_durable.step_async(step, _effect, job_id, step)
