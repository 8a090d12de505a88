"""Running jobs in a test as a worker would: ``perform_job_async`` runs one handler,
``drain_async`` every ready job through the worker's statements. Written once, async;
``running.py`` (``perform_job``, ``drain``) is its sync twin, generated from this file
by tools/async_to_sync.py. What they decide without I/O is in ``runs``."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg

from skiplock import client
from skiplock.app import App
from skiplock.context import set_current_job
from skiplock.durable import LockedStore, set_step_store
from skiplock.executor import TransactionalRun, claimed_from_row, run_transactional_async
from skiplock.outcomes import Completed
from skiplock.tasks import Task, TaskCall
from skiplock.testing import runs
from skiplock.types import ClaimedJob, Job

AsyncConn = psycopg.AsyncConnection[Any]


async def server_now_async(conn: AsyncConn) -> datetime:
    """The transaction's now(): the time jobs enqueued in it were given."""
    cur = await conn.execute(runs.SERVER_NOW)
    row = await cur.fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


async def _ensure_transaction_async(conn: AsyncConn) -> None:
    """Open ``conn``'s transaction if none is: ``conn.transaction()`` is then a savepoint
    in it, not a transaction of its own that would commit."""
    if runs.needs_transaction(conn):
        await conn.execute(runs.SERVER_NOW)


async def perform_job_async(
    task: Task[Any] | TaskCall[Any], conn: AsyncConn | None = None, /, **args: Any
) -> runs.JobOutcome:
    """Run ``task``'s handler once, as a worker would, and return what came of it.

    The arguments are checked and encoded as ``enqueue`` does and decoded from that JSON;
    the result goes through JSON too; ``current_job()`` is the job (id 0, attempt 1);
    ``set_progress`` is kept in the outcome; a raised exception becomes the failure a
    worker records, with the retry or dead decision. A transactional task needs ``conn``
    (a psycopg.AsyncConnection here, a psycopg.Connection for ``perform_job``): its
    handler runs in a savepoint of ``conn``'s transaction, rolled back if it fails (its
    writes stay otherwise, for the test to read and roll back)."""
    plain = runs.task_of(task)
    runs.check_perform(plain, conn, psycopg.AsyncConnection)
    spec = task.job(**args)
    if conn is None:
        job = runs.performed_job(spec, attempts=1)
        progress = runs.Progress()
        outcome = await runs.leased_outcome_async(plain.app, job, progress, None)
        return runs.job_outcome(job, outcome, progress.value)
    job = runs.performed_job(spec, attempts=0)
    await _ensure_transaction_async(conn)
    set_current_job(job)
    set_step_store(LockedStore(conn, plain.app.schema))
    try:
        async with conn.transaction():
            result_json = await runs.call_transactional_async(plain, conn, job.args)
        outcome = Completed(job.id, job.attempts + 1, result_json)
    except Exception as exc:
        outcome = runs.transactional_failure(plain, job, exc)
    finally:
        set_current_job(None)
    return runs.job_outcome(job, outcome)


# -- drain: every ready job, in the test's transaction -----------------------------------


async def _ready_async(conn: AsyncConn, app: App) -> list[Job]:
    return await client.list_jobs_async(conn, app.schema, state="available", limit=runs.LIST_LIMIT)


async def drain_async(
    conn: AsyncConn,
    app: App,
    /,
    *,
    queues: Sequence[str] | None = None,
    max_runs: int = runs.MAX_RUNS,
) -> list[runs.JobOutcome]:
    """Run every ready job of ``queues`` (default: every queue with ready jobs) in this
    process, until none is left, and return what each run came to, in order.

    Jobs are claimed and their outcomes written with the worker's statements, through
    ``conn``: inside its transaction, so a test's rollback undoes them. Jobs a handler
    enqueues are run too; a job retried later, scheduled or blocked behind its key is not
    ready and is left. Lease-mode handlers run as a worker runs them (threads for sync
    ones); transactional ones run on ``conn`` in a savepoint, as in a worker: async ones
    with ``drain_async`` (a psycopg.AsyncConnection), sync ones with ``drain`` (a
    psycopg.Connection)."""
    state = runs.Drain(app, queues, psycopg.AsyncConnection, max_runs=max_runs)
    await _ensure_transaction_async(conn)
    while True:
        ready = await _ready_async(conn, app)
        queues_now = state.queues_from(ready)
        state.check_left(ready, queues_now)
        ran = len(state.outcomes)
        for queue in queues_now:
            while True:
                if await _drain_leased_one_async(conn, state, queue):
                    continue
                if not await _drain_locked_one_async(conn, state, queue):
                    break
        if len(state.outcomes) == ran:
            cur = await conn.execute(runs.SERVER_CLOCKS)
            row = await cur.fetchone()
            assert row is not None
            state.check_too_new(ready, queues_now, *row)
            return state.outcomes


async def _drain_leased_one_async(conn: AsyncConn, state: runs.Drain, queue: str) -> bool:
    cur = await conn.execute(*state.claim(queue))
    rows = await cur.fetchall()
    if not rows:
        return False
    job = claimed_from_row(rows[0])
    progress = runs.Progress()
    outcome = await runs.leased_outcome_async(state.app, job, progress, conn, state.worker_id)
    outcome = dataclasses.replace(outcome, progress_json=progress.json)
    try:
        async with conn.transaction():
            for statement in state.writes(outcome):
                await conn.execute(*statement)
    except (psycopg.DataError, psycopg.IntegrityError) as refusal:  # a value refused
        outcome, statement = state.refused(job, outcome, refusal)
        await conn.execute(*statement)
    state.add(runs.job_outcome(job, outcome, progress.value))
    return True


async def _drain_locked_one_async(conn: AsyncConn, state: runs.Drain, queue: str) -> bool:
    tasks = state.runnable_transactional
    if not tasks:
        return False
    finished: list[tuple[ClaimedJob, str, dict[str, Any] | None]] = []
    await run_transactional_async(
        conn,
        TransactionalRun(
            state.app,
            queue,
            tasks,
            1,
            rng=random.Random(),
            governed=True,  # limits aside: a test's drain runs one job at a time
            on_finished=lambda job, outcome, seconds: finished.append(
                (job, outcome.kind, outcome.error)
            ),
        ),
    )
    for job, kind, error in finished:
        row = await client.get_job_async(conn, state.app.schema, job.id)
        now = await server_now_async(conn)
        state.add(state.transactional_outcome(job, kind, error, row, now))
    return bool(finished)
