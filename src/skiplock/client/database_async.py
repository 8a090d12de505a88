"""The client's statements on the caller's connection: enqueue, and the admin reads and
writes. Written once, async; ``database.py`` is its sync twin, generated from this file
by tools/async_to_sync.py.

Enqueue never commits: the job becomes visible exactly when the caller's transaction
commits, and vanishes with it on rollback. What is sent is decided by the pure functions
of ``params``; these shells only execute.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack

import psycopg
from psycopg.rows import dict_row

from skiplock.client import params
from skiplock.config import control_channel, notify_channel, results_notice
from skiplock.errors import JobNotFoundError
from skiplock.sql import admin, enqueue, periodic, render, replica, signals
from skiplock.tasks import JobSpec
from skiplock.types import Job

AsyncConn = psycopg.AsyncConnection[Any]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _needs_schema_async(
    fn: Callable[Concatenate[AsyncConn, str, _P], Awaitable[_T]],
) -> Callable[Concatenate[AsyncConn, str, _P], Awaitable[_T]]:
    """A missing schema or table raises SchemaNotReadyError, which names the command
    that creates them."""

    @functools.wraps(fn)
    async def wrapper(conn: AsyncConn, schema: str, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await fn(conn, schema, *args, **kwargs)
        except params.SCHEMA_MISSING as exc:
            raise params.schema_not_ready(schema, exc) from exc

    return wrapper


async def _insert_windowed_async(
    conn: AsyncConn, schema: str, spec: JobSpec, meta: str | None
) -> tuple[int, bool]:
    """A unique job with a time window: the window's key first (a plain read, so that a
    duplicate takes no lock), then the job under its scope's index."""
    window = params.window_params(schema, spec)
    unique = params.unique_params(schema, spec, meta)
    while True:
        cur = await conn.execute(render(enqueue.JOB_FIND_WINDOW, schema), window)
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), False
        cur = await conn.execute(render(enqueue.JOB_WINDOW_TAKE, schema), window)
        row = await cur.fetchone()
        if row is None:
            continue  # taken meanwhile: read the holder
        stand_in = int(row[0])
        cur = await conn.execute(
            render(params.with_meta(enqueue.JOB_INSERT_WINDOWED, meta), schema),
            {**unique, "id": stand_in},
        )
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), True
        # A live job in the scope holds the key: no new job, so the window is not taken.
        await conn.execute(render(enqueue.JOB_WINDOW_GIVE_BACK, schema), {**window, "id": stand_in})
        cur = await conn.execute(render(enqueue.JOB_FIND_UNIQUE, schema), unique)
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), False


@_needs_schema_async
async def insert_job_async(
    conn: AsyncConn, schema: str, spec: JobSpec, *, meta: str | None = None
) -> tuple[int, bool]:
    """Insert one job; returns (id, inserted). Not inserted: a live job holds its unique
    key (or its window has not passed), and the id is that job's. ``meta``: JSON object
    text for the job's meta column (a trace context; skiplock/tracing.py), to which the
    job's tags are added."""
    meta = params.job_meta(spec, meta)
    if spec.unique_key is None:
        cur = await conn.execute(
            render(params.with_meta(enqueue.JOB_INSERT, meta), schema),
            params.one_params(spec, meta),
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0]), True
    if spec.unique_window is not None:
        return await _insert_windowed_async(conn, schema, spec, meta)
    unique = params.unique_params(schema, spec, meta)
    while True:
        cur = await conn.execute(
            render(params.with_meta(enqueue.JOB_INSERT_UNIQUE, meta), schema), unique
        )
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), True
        if spec.replace:
            cur = await conn.execute(render(enqueue.JOB_REPLACE_WAITING, schema), unique)
            row = await cur.fetchone()
            if row is not None and row[0] is not None:
                return int(row[0]), False
            # No holder waits: one that started is looked up, a gone one makes room.
        cur = await conn.execute(render(enqueue.JOB_FIND_UNIQUE, schema), unique)
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), False
        # The holder finished in between: try the insert again.


async def _insert_unique_many_async(
    conn: AsyncConn, schema: str, specs: Sequence[JobSpec], meta: str | None
) -> list[int]:
    """Unique jobs (and any others in the same batch) in one INSERT ... ON CONFLICT; the
    ids of duplicates are their holders'. A holder that left its scope before it was looked
    up frees its key: its jobs are inserted again, as insert_job does. Order follows
    ``specs``."""
    by_key: dict[params.UniqueKey, int] = {}
    plain: list[int] = []
    batch: Sequence[JobSpec] = specs
    while batch:
        cur = await conn.execute(
            render(params.with_meta(enqueue.JOB_INSERT_MANY_UNIQUE, meta, batch), schema),
            params.many_unique_params(batch, meta),
        )
        inserted, new_plain, missing = params.inserted_by_key(batch, await cur.fetchall())
        by_key.update(inserted)
        plain.extend(new_plain)
        if missing["active"] or missing["queued"]:
            cur = await conn.execute(
                render(enqueue.JOB_FIND_UNIQUE_MANY, schema),
                {"keys": missing["active"], "queued_keys": missing["queued"]},
            )
            by_key.update(params.inserted_by_key(batch, await cur.fetchall())[0])
        batch = params.unresolved(specs, by_key)
    return params.ids_in_order(specs, by_key, plain)


@_needs_schema_async
async def insert_jobs_async(
    conn: AsyncConn, schema: str, specs: Sequence[JobSpec], *, meta: str | None = None
) -> list[int]:
    """COPY, with the ids read back: three round trips for any number of jobs. A batch with
    unique jobs goes through INSERT ... ON CONFLICT instead (COPY cannot skip duplicates).
    ``meta`` is stored with every job of the batch."""
    if not specs:
        return []
    if any(s.unique_window is not None or s.replace for s in specs):
        # Windows are taken and holders replaced key by key: a round trip or more per job.
        ids = []
        for spec in specs:
            job_id, _ = await insert_job_async(conn, schema, spec, meta=meta)
            ids.append(job_id)
        return ids
    if any(s.unique_key for s in specs):
        return await _insert_unique_many_async(conn, schema, specs, meta)
    # Three statements that must meet one session (currval), which only a transaction
    # guarantees behind a transaction-mode pooler; the caller's, if it has one.
    async with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        table = params.table_params(schema)
        cur = await conn.execute(render(enqueue.JOB_COPY_BEGIN, schema), table)
        row = await cur.fetchone()
        assert row is not None
        now, after = row
        keyed = any(s.ordering_key for s in specs)
        statement = enqueue.JOB_COPY_IN_KEYED if keyed else enqueue.JOB_COPY_IN
        copy_in = render(params.with_meta(statement, meta, specs), schema)
        async with conn.cursor().copy(copy_in) as copy:
            for chunk in params.copy_chunks(specs, now, keyed=keyed, meta=meta):
                await copy.write(chunk)
        cur = await conn.execute(render(enqueue.JOB_COPY_IDS, schema), {**table, "after": after})
        rows = await cur.fetchall()
    return params.copied_ids(rows, len(specs))


# -- admin: jobs -------------------------------------------------------------------------


@_needs_schema_async
async def send_signal_async(
    conn: AsyncConn, schema: str, key: str, payload_json: str, *, kept_for: float
) -> int | None:
    """Send the signal ``key`` in ``conn``'s transaction (never commits): the id of the
    job it resumes, or None when it is kept for a wait to come."""
    cur = await conn.execute(
        render(signals.SIGNAL_SEND, schema),
        {"key": key, "payload": payload_json, "kept_for": kept_for},
    )
    row = await cur.fetchone()
    return None if row is None or row[0] is None else int(row[0])


async def get_job_async(conn: AsyncConn, schema: str, job_id: int) -> Job:
    """One job by id, live or from history; JobNotFoundError when there is none."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(render(admin.JOB_GET, schema), {"id": job_id})
        row = await cur.fetchone()
    if row is None:
        raise JobNotFoundError(f"no job with id {job_id}")
    return params.job_from_row(row)


async def list_jobs_async(
    conn: AsyncConn, schema: str, *, limit: int = 100, **filters: Unpack[params.JobFilters]
) -> list[Job]:
    """Live jobs (not history) matching every filter given; ``older_than`` in seconds."""
    values = {**params.filter_params(filters), "limit": limit}
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(render(admin.JOB_LIST, schema), values)
        rows = await cur.fetchall()
    return [params.job_from_row(r) for r in rows]


async def select_job_ids_async(
    conn: AsyncConn, schema: str, **filters: Unpack[params.JobFilters]
) -> list[int]:
    """Ids of the live jobs a bulk retry, cancel or delete would act on; with a state of
    history that can be replayed (REPLAYABLE_STATES), those finished jobs' ids."""
    finished = filters.get("state") in admin.REPLAYABLE_STATES
    statement = admin.JOB_SELECT_REPLAYABLE_IDS if finished else admin.JOB_SELECT_IDS
    cur = await conn.execute(render(statement, schema), params.filter_params(filters))
    return [int(r[0]) for r in await cur.fetchall()]


async def retry_jobs_async(conn: AsyncConn, schema: str, ids: Sequence[int]) -> int:
    """Send dead (or waiting) jobs back to their queues with fresh attempts, and enqueue
    completed or cancelled ones again (replay_jobs); running jobs are left alone. Returns
    how many moved or were enqueued again."""
    cur = await conn.execute(
        render(admin.JOB_RETRY, schema), {"ids": list(ids), "channel": notify_channel(schema)}
    )
    moved = sum(int(r[1]) for r in await cur.fetchall())
    return moved + len(await replay_jobs_async(conn, schema, ids))


async def replay_jobs_async(conn: AsyncConn, schema: str, ids: Sequence[int]) -> dict[int, int]:
    """Enqueue again, each as a new job, the completed or cancelled jobs of ``ids`` in
    history (JOB_REPLAYABLE); returns {original id: the copy's id}. Other ids are left."""
    cur = await conn.execute(render(admin.JOB_REPLAYABLE, schema), {"ids": list(ids)})
    copies: dict[int, int] = {}
    for job_id, queue, task, args, priority, max_attempts, key, tags in await cur.fetchall():
        spec = JobSpec(
            task, args, queue, priority, max_attempts, ordering_key=key, tags=params.tags_of(tags)
        )
        meta = json.dumps({"replay_of": job_id})
        copies[job_id], _ = await insert_job_async(conn, schema, spec, meta=meta)
    return copies


async def cancel_jobs_async(conn: AsyncConn, schema: str, ids: Sequence[int]) -> int:
    """Cancel jobs: waiting and dead ones move to history as cancelled at once; for
    running (lease-mode) ones the worker is asked to stop them, and it records the
    cancellation. Returns how many were cancelled or asked to stop.

    Running ones first: the completion of a running step locks its job's row, then its
    workflow's; a cancel of waiting steps locks their workflow's (their DELETE's trigger
    ends them), so asking a running step to stop after that could wait for a completion
    that waits for this transaction. The waiting ones' step rows are locked before their
    jobs, as a parent's completion locks them (it counts a child, then releases it)."""
    cur = await conn.execute(
        render(admin.JOB_CANCEL_RUNNING, schema),
        {"ids": list(ids), "channel": control_channel(schema)},
    )
    running = await cur.fetchall()
    await conn.execute(render(admin.WORKFLOW_STEPS_LOCK, schema), {"ids": list(ids)})
    cur = await conn.execute(render(admin.JOB_CANCEL_WAITING, schema), {"ids": list(ids)})
    waiting = await cur.fetchall()
    if waiting:  # wake anyone awaiting these jobs' results
        await conn.execute(*results_notice(schema))
    return len(waiting) + len(running)


async def delete_jobs_async(conn: AsyncConn, schema: str, ids: Sequence[int]) -> int:
    """Remove jobs that are not running, leaving no history (their step rows locked
    first, as a cancel locks them)."""
    await conn.execute(render(admin.WORKFLOW_STEPS_LOCK, schema), {"ids": list(ids)})
    cur = await conn.execute(render(admin.JOB_DELETE, schema), {"ids": list(ids)})
    return len(await cur.fetchall())


async def _one_async(done: int, conn: AsyncConn, schema: str, job_id: int, verb: str) -> None:
    """A change of one job that touched no row says why (JobNotFoundError)."""
    if done == 0:
        job = await get_job_async(conn, schema, job_id)  # raises when there is none
        raise params.not_changed(job, verb)


async def retry_job_async(conn: AsyncConn, schema: str, job_id: int) -> int:
    """Retry one job (retry_jobs): the id of the job that runs, ``job_id`` itself or, for a
    finished one, its copy. JobNotFoundError says why when it cannot be."""
    cur = await conn.execute(
        render(admin.JOB_RETRY, schema), {"ids": [job_id], "channel": notify_channel(schema)}
    )
    if sum(int(r[1]) for r in await cur.fetchall()):
        return job_id
    copies = await replay_jobs_async(conn, schema, [job_id])
    if job_id in copies:
        return copies[job_id]
    await _one_async(0, conn, schema, job_id, "be retried")
    raise AssertionError("unreachable: _one_async raises when nothing changed")


async def cancel_job_async(conn: AsyncConn, schema: str, job_id: int) -> None:
    """Cancel one job (cancel_jobs); JobNotFoundError says why when it cannot be."""
    done = await cancel_jobs_async(conn, schema, [job_id])
    await _one_async(done, conn, schema, job_id, "be cancelled")


async def delete_job_async(conn: AsyncConn, schema: str, job_id: int) -> None:
    """Delete one job (delete_jobs); JobNotFoundError says why when it cannot be."""
    done = await delete_jobs_async(conn, schema, [job_id])
    await _one_async(done, conn, schema, job_id, "be deleted")


# -- admin: queues and workers -------------------------------------------------------------


async def set_queue_paused_async(conn: AsyncConn, schema: str, queue: str, *, paused: bool) -> None:
    """Pause (no claims from the next one on) or resume a queue; resuming wakes workers."""
    await conn.execute(render(admin.QUEUE_SET_PAUSED, schema), {"queue": queue, "paused": paused})
    if not paused:
        await conn.execute(
            render(admin.QUEUE_WAKE, schema), {"queue": queue, "channel": notify_channel(schema)}
        )


async def set_queue_limits_async(
    conn: AsyncConn,
    schema: str,
    queue: str,
    *,
    concurrency: int | None = None,
    rate: tuple[int, float] | str | None = None,
) -> None:
    """Limit a queue across all workers: at most ``concurrency`` jobs running at once and
    ``rate`` = (jobs, seconds) or "100/s" started per period. None removes a limit.
    Workers pick the change up before their next claim of the queue (and within a few
    seconds if the message is missed)."""
    limits = params.limits_params(queue, concurrency, rate)
    await conn.execute(render(admin.QUEUE_SET_LIMITS, schema), limits)
    await conn.execute(
        render(admin.QUEUE_LIMITS_CHANGED, schema), {"channel": control_channel(schema)}
    )


async def list_queues_async(conn: AsyncConn, schema: str) -> list[dict[str, Any]]:
    """Queues with settings: paused or limited."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(render(admin.QUEUE_LIST, schema))
        return await cur.fetchall()


async def paused_queues_async(conn: AsyncConn, schema: str) -> list[str]:
    """The names of the paused queues."""
    cur = await conn.execute(render(admin.QUEUE_LIST_PAUSED, schema))
    return [str(r[0]) for r in await cur.fetchall()]


async def queue_stats_async(conn: AsyncConn, schema: str) -> list[dict[str, Any]]:
    """Per queue: its live jobs by state, the age of its oldest ready job, what finished
    in the last minute, and the workers serving it."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(render(admin.QUEUE_STATS, schema))
        return await cur.fetchall()


async def list_workers_async(conn: AsyncConn, schema: str) -> list[dict[str, Any]]:
    """The registered workers, the leader marked."""
    # A hot standby says so at connection (in_hot_standby, PostgreSQL 14+); it cannot read
    # the leader table, so the leader is unknown there (skiplock status --read-url).
    standby = conn.info.parameter_status("in_hot_standby") == "on"
    statement = replica.WORKER_LIST_ON_STANDBY if standby else admin.WORKER_LIST
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(render(statement, schema))
        return await cur.fetchall()


# -- cron schedules (as the workers that tick them describe them; migration 0030) -----


async def list_schedules_async(conn: AsyncConn, schema: str) -> list[dict[str, Any]]:
    """Every schedule a worker has ticked: its expression, the job it enqueues, its last
    and next tick, whether it is paused."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(render(periodic.PERIODIC_LIST, schema))
        return await cur.fetchall()


async def set_schedule_paused_async(
    conn: AsyncConn, schema: str, name: str, *, paused: bool
) -> None:
    """Pause a schedule (its ticks pass without jobs, none owed on resume) or resume it."""
    cur = await conn.execute(
        render(periodic.PERIODIC_SET_PAUSED, schema), {"name": name, "paused": paused}
    )
    if await cur.fetchone() is None:
        raise params.no_schedule(name)


async def run_schedule_now_async(conn: AsyncConn, schema: str, name: str) -> int:
    """Enqueue a schedule's job now, as its next tick would, from its description;
    returns the job's id. The schedule's own ticks go on as before."""
    rows = [row for row in await list_schedules_async(conn, schema) if row["name"] == name]
    if not rows:
        raise params.no_schedule(name)
    spec = params.schedule_job(rows[0])
    job_id, _ = await insert_job_async(conn, schema, spec)
    return job_id
