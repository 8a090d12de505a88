"""A graceful stop: claim nothing more, let running jobs finish, write every outcome.

In order: transactional batches start no further job (decision 002); producers stop and
the wake-up session hands its queues to other workers; claims in flight deliver their
jobs; jobs claimed ahead go back at once (decision 018); running jobs get up to the
shutdown timeout, then are released with their attempt given back; the completer writes
what finished; the worker deregisters and resigns leadership. Every write is bounded:
whatever is not written is rescued (liveness, or lease expiry) and runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import psycopg

from skiplock.completer import fenced_batch
from skiplock.config import notify_channel, results_notice
from skiplock.sql import complete, maintenance, render
from skiplock.wording import plural

if TYPE_CHECKING:
    from skiplock.worker.assembly import Parts

log = logging.getLogger("skiplock.worker")

FINAL_WRITES_SECONDS = 15.0


async def shut_down(parts: Parts, *, abandon: asyncio.Event) -> int:
    """Stop every service of ``parts``; returns how many sync handlers were abandoned
    still running (their threads cannot be stopped)."""
    parts.sessions.stop()
    await parts.supervisor.stop(p.name for p in parts.producers)
    if parts.wakeups is not None:
        # Nothing here claims any more: the queue's other workers take over.
        with contextlib.suppress(psycopg.Error):
            await parts.wakeups.hand_over()
    # A claim in flight when its producer was cancelled still delivers its jobs.
    in_flight = [p.pending for p in parts.producers if p.pending and not p.pending.done()]
    await asyncio.gather(*in_flight, return_exceptions=True)
    # Heartbeats and the completer keep running while jobs finish.
    abandoned = await drain(parts, abandon=abandon)
    await parts.supervisor.stop()
    await _leave(parts)
    if parts.wakeups is not None:
        await parts.wakeups.close()
    return abandoned


async def _leave(parts: Parts) -> None:
    # Bounded like every maintenance statement: a user's lock on the leader row must not
    # keep the process from exiting (the row then simply expires).
    worker_id = parts.worker.id
    with contextlib.suppress(psycopg.Error):
        async with parts.pools.maintenance.connection() as conn:
            await conn.execute(
                render(maintenance.WORKER_DEREGISTER, parts.schema), {"id": worker_id}
            )
            await conn.execute(
                render(maintenance.LEADER_RESIGN, parts.schema), {"worker_id": worker_id}
            )


async def drain(parts: Parts, *, abandon: asyncio.Event) -> int:
    """Let running jobs finish (up to the shutdown timeout), then write every outcome.

    Jobs still running at the timeout are released: back to the queue at once with the
    attempt given back (it was cut short, not failed) and a WorkerShutdown note. Returns
    the sync handlers abandoned still running.
    """
    # Jobs claimed ahead that never started go back now, before the running jobs are
    # waited for: another worker can run them meanwhile (decision 018).
    parts.jobs.give_back_waiting()
    unfinished, abandoned = await _wait_for_running(parts, abandon)
    await _final_writes(parts, unfinished)
    return abandoned


async def _wait_for_running(parts: Parts, abandon: asyncio.Event) -> tuple[dict[int, int], int]:
    """Wait for the running jobs until the timeout or a second signal; cut short the ones
    still running. Returns those of lease mode (job id: attempt) and the abandoned threads."""
    jobs, sessions = parts.jobs, parts.sessions
    running = [entry.task for entry in jobs.running_jobs] + list(sessions.running)
    if not running:
        return {}, 0
    timeout = max(parts.options.shutdown_timeout, 0.001)
    finished = asyncio.ensure_future(asyncio.wait(running, timeout=timeout))
    abandoning = asyncio.ensure_future(abandon.wait())
    await asyncio.wait({finished, abandoning}, return_when=asyncio.FIRST_COMPLETED)
    abandoning.cancel()
    still = {task for task in running if not task.done()}
    unfinished: dict[int, int] = {}
    abandoned = 0
    for entry in jobs.running_jobs:
        if entry.task in still:
            unfinished[entry.id] = entry.attempt
            if jobs.runs_in_thread(entry):
                abandoned += 1  # a thread cannot be cancelled
            jobs.cut_short(entry)
    # Their running jobs cut short, the batches commit what finished before them.
    abandoned += await sessions.cut_short()
    return unfinished, abandoned


async def _final_writes(parts: Parts, unfinished: dict[int, int]) -> None:
    # Bounded: a write stuck behind a lock must not keep the process from exiting.
    completer, loop = parts.completer, asyncio.get_running_loop()
    deadline = loop.time() + FINAL_WRITES_SECONDS
    while loop.time() < deadline:
        remaining = deadline - loop.time()
        try:
            await asyncio.wait_for(parts.jobs.given_back_written(), remaining)
            if completer.backlog:
                # The completer service writes them: one flusher at a time, or two would
                # write (and then drop) the same batch.
                await asyncio.wait_for(completer.wait_drained(), remaining)
            if unfinished:
                await asyncio.wait_for(_release(parts, unfinished), remaining)
                unfinished = {}
            if not completer.backlog:
                return
        except (TimeoutError, psycopg.Error) as exc:
            # Any database error, not only a lost connection: retried until the deadline.
            log.warning("final writes failed (%r); retrying", exc)
            await asyncio.sleep(0.2)
    log.error(
        "gave up writing %d outcomes at shutdown; their jobs will be rescued and re-run",
        completer.backlog + len(unfinished),
    )


async def _release(parts: Parts, jobs: dict[int, int]) -> None:
    schema = parts.schema
    async with parts.pools.claims.connection() as conn:
        cur = await conn.execute(
            render(complete.JOB_RELEASE_MANY_IF_LEASED, schema),
            {
                **fenced_batch({job_id: {"attempt": a} for job_id, a in jobs.items()}),
                "worker_id": parts.worker.id,
                "channel": notify_channel(schema),
            },
        )
        rows = await cur.fetchall()
        released = sum(int(row[1]) for row in rows if row[0] is not None)
        cancelled = sum(int(row[1]) for row in rows if row[0] is None)
        if cancelled:
            await conn.execute(*results_notice(schema))
    log.warning("released %s back to their queues", plural(released, "unfinished job"))
    if cancelled:
        log.warning("ended %s cancelled, as was asked", plural(cancelled, "unfinished job"))
