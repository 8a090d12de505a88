"""Writing jobs into the caller's connection, and the admin reads and writes.

Enqueue never commits: the job becomes visible exactly when the caller's transaction
commits, and vanishes with it on rollback. Parameters are built by pure functions shared
by the sync and async shells, which only execute.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg
from psycopg.rows import dict_row

from skiplock.config import control_channel, done_channel, notify_channel
from skiplock.errors import ConfigurationError, JobNotFoundError, SchemaNotReadyError
from skiplock.sql import admin, complete, enqueue, render, replica
from skiplock.tasks import JobSpec, check_rate
from skiplock.types import Job, JobState

Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Enqueueing before `skiplock migrate` reaches a schema or table that is not there; the
# error names the command instead of leaving a bare UndefinedTable.
_SCHEMA_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)


def _schema_not_ready(schema: str, exc: psycopg.Error) -> SchemaNotReadyError:
    return SchemaNotReadyError(
        f"skiplock's tables are not in schema {schema!r} of this database "
        f"({str(exc).strip().splitlines()[0]}): run `skiplock migrate` first"
    )


def _needs_schema(
    fn: Callable[Concatenate[Conn, str, _P], _T],
) -> Callable[Concatenate[Conn, str, _P], _T]:
    @functools.wraps(fn)
    def wrapper(conn: Conn, schema: str, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return fn(conn, schema, *args, **kwargs)
        except _SCHEMA_MISSING as exc:
            raise _schema_not_ready(schema, exc) from exc

    return wrapper


def _needs_schema_async(
    fn: Callable[Concatenate[AsyncConn, str, _P], Awaitable[_T]],
) -> Callable[Concatenate[AsyncConn, str, _P], Awaitable[_T]]:
    @functools.wraps(fn)
    async def wrapper(conn: AsyncConn, schema: str, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await fn(conn, schema, *args, **kwargs)
        except _SCHEMA_MISSING as exc:
            raise _schema_not_ready(schema, exc) from exc

    return wrapper


def _one_params(spec: JobSpec, meta: str | None = None) -> dict[str, Any]:
    return {
        "queue": spec.queue,
        "task": spec.task,
        "args": spec.args_json,
        "priority": spec.priority,
        "run_at": spec.run_at,
        "delay": spec.delay,
        "max_attempts": spec.max_attempts,
        "ordering_key": spec.ordering_key,
        "key_limit": spec.key_limit,
        "key_rate": spec.key_rate[0] if spec.key_rate else None,
        "key_period": spec.key_rate[1] if spec.key_rate else None,
        "meta": meta,
    }


# Bulk enqueue writes COPY's text format itself, a few thousand rows per write: psycopg's
# write_row formats each value of each row (2.6 us a job), and separate writes let the
# server take in one chunk while the next is built.
COPY_CHUNK_ROWS = 2000
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_field(value: object) -> str:
    """``value`` in COPY's text format: None is \\N; a backslash, tab or line break in
    text is escaped, so that a job's own text can never end its field or row."""
    if value is None:
        return "\\N"
    text = str(value)
    if "\\" in text or "\t" in text or "\n" in text or "\r" in text:
        return text.translate(_COPY_ESCAPES)
    return text


def _copy_chunks(
    specs: Sequence[JobSpec],
    now: datetime,
    *,
    keyed: bool = False,
    meta: str | None = None,
) -> Iterator[str]:
    """COPY text for JOB_COPY_IN (JOB_COPY_IN_KEYED when ``keyed``), COPY_CHUNK_ROWS rows
    at a time: run_at and state decided against the transaction's now(). With ``meta``,
    every row ends with it (the _META statements)."""
    meta_field = None if meta is None else _copy_field(meta)
    # Queue and task names and due times repeat across a batch: each is formatted once.
    names: dict[object, str] = {}
    due: dict[tuple[datetime | None, float], tuple[str, bool]] = {}
    lines: list[str] = []
    # In UTC: an odd offset (fractions of a second) cannot trouble COPY, and a delay is
    # added as elapsed time, as now() + interval is, not as wall-clock time across DST.
    now = now.astimezone(UTC)
    for spec in specs:
        when = (spec.run_at, spec.delay)
        if when not in due:
            run_at = (
                spec.run_at.astimezone(UTC)
                if spec.run_at
                else (now + timedelta(seconds=spec.delay) if spec.delay else now)
            )
            due[when] = (_copy_field(run_at), run_at > now)
        run_at_text, later = due[when]
        if spec.ordering_key is not None:
            state = "blocked"
        else:
            state = "scheduled" if later else "available"
        queue = names.get(spec.queue) or names.setdefault(spec.queue, _copy_field(spec.queue))
        task = names.get(spec.task) or names.setdefault(spec.task, _copy_field(spec.task))
        line = (
            f"{queue}\t{task}\t{_copy_field(spec.args_json)}\t{spec.priority}\t"
            f"{run_at_text}\t{state}\t{spec.max_attempts}"
        )
        if keyed:
            rate, period = spec.key_rate or (None, None)
            line = (
                f"{line}\t{_copy_field(spec.ordering_key)}\t{spec.key_limit}\t"
                f"{_copy_field(rate)}\t{_copy_field(period)}"
            )
        if meta_field is not None:
            line = f"{line}\t{meta_field}"
        lines.append(line)
        if len(lines) == COPY_CHUNK_ROWS:
            lines.append("")
            yield "\n".join(lines)
            lines = []
    if lines:
        lines.append("")
        yield "\n".join(lines)


def _meta(statement: str, meta: str | None) -> str:
    """The statement, or its twin that also writes the jobs' meta when there is one."""
    return statement if meta is None else enqueue.WITH_META[statement]


def _table_params(schema: str) -> dict[str, Any]:
    return {"table": f'"{schema}".jobs'}


def _copied_ids(rows: Sequence[Sequence[Any]], count: int) -> list[int]:
    """The ids JOB_COPY_IDS found, which must be one per job sent."""
    ids = [int(row[0]) for row in rows]
    if len(ids) != count:  # pragma: no cover - a broken invariant, never a user's error
        raise RuntimeError(f"bulk enqueue copied {count} jobs but found {len(ids)} ids")
    return ids


def _unique_params(schema: str, spec: JobSpec, meta: str | None = None) -> dict[str, Any]:
    active = spec.unique_key if spec.unique_scope == "active" else None
    queued = spec.unique_key if spec.unique_scope == "queued" else None
    return {
        **_one_params(spec, meta),
        "unique_key": active,
        "unique_queued_key": queued,
    }


def _window_params(schema: str, spec: JobSpec) -> dict[str, Any]:
    return {
        "table": f'"{schema}".jobs',
        "unique_key": spec.unique_key,
        "window": spec.unique_window,
    }


def _insert_windowed(conn: Conn, schema: str, spec: JobSpec, meta: str | None) -> tuple[int, bool]:
    """A unique job with a time window: the window's key first (a plain read, so that a
    duplicate takes no lock), then the job under its scope's index."""
    window = _window_params(schema, spec)
    params = _unique_params(schema, spec, meta)
    while True:
        row = conn.execute(render(enqueue.JOB_FIND_WINDOW, schema), window).fetchone()
        if row is not None:
            return int(row[0]), False
        row = conn.execute(render(enqueue.JOB_WINDOW_TAKE, schema), window).fetchone()
        if row is None:
            continue  # taken meanwhile: read the holder
        stand_in = int(row[0])
        row = conn.execute(
            render(_meta(enqueue.JOB_INSERT_WINDOWED, meta), schema), {**params, "id": stand_in}
        ).fetchone()
        if row is not None:
            return int(row[0]), True
        # A live job in the scope holds the key: no new job, so the window is not taken.
        conn.execute(render(enqueue.JOB_WINDOW_GIVE_BACK, schema), {**window, "id": stand_in})
        row = conn.execute(render(enqueue.JOB_FIND_UNIQUE, schema), params).fetchone()
        if row is not None:
            return int(row[0]), False


async def _insert_windowed_async(
    conn: AsyncConn, schema: str, spec: JobSpec, meta: str | None
) -> tuple[int, bool]:
    window = _window_params(schema, spec)
    params = _unique_params(schema, spec, meta)
    while True:
        cur = await conn.execute(render(enqueue.JOB_FIND_WINDOW, schema), window)
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), False
        cur = await conn.execute(render(enqueue.JOB_WINDOW_TAKE, schema), window)
        row = await cur.fetchone()
        if row is None:
            continue
        stand_in = int(row[0])
        cur = await conn.execute(
            render(_meta(enqueue.JOB_INSERT_WINDOWED, meta), schema), {**params, "id": stand_in}
        )
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), True
        await conn.execute(render(enqueue.JOB_WINDOW_GIVE_BACK, schema), {**window, "id": stand_in})
        cur = await conn.execute(render(enqueue.JOB_FIND_UNIQUE, schema), params)
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), False


@_needs_schema
def insert_job(
    conn: Conn, schema: str, spec: JobSpec, *, meta: str | None = None
) -> tuple[int, bool]:
    """Insert one job; returns (id, inserted). Not inserted: a live job holds its unique
    key (or its window has not passed), and the id is that job's. ``meta``: JSON object
    text for the job's meta column (a trace context; skiplock/tracing.py)."""
    if spec.unique_key is None:
        row = conn.execute(
            render(_meta(enqueue.JOB_INSERT, meta), schema), _one_params(spec, meta)
        ).fetchone()
        assert row is not None
        return int(row[0]), True
    if spec.unique_window is not None:
        return _insert_windowed(conn, schema, spec, meta)
    params = _unique_params(schema, spec, meta)
    while True:
        row = conn.execute(
            render(_meta(enqueue.JOB_INSERT_UNIQUE, meta), schema), params
        ).fetchone()
        if row is not None:
            return int(row[0]), True
        row = conn.execute(render(enqueue.JOB_FIND_UNIQUE, schema), params).fetchone()
        if row is not None:
            return int(row[0]), False
        # The holder finished in between: try the insert again.


@_needs_schema_async
async def insert_job_async(
    conn: AsyncConn, schema: str, spec: JobSpec, *, meta: str | None = None
) -> tuple[int, bool]:
    if spec.unique_key is None:
        cur = await conn.execute(
            render(_meta(enqueue.JOB_INSERT, meta), schema), _one_params(spec, meta)
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0]), True
    if spec.unique_window is not None:
        return await _insert_windowed_async(conn, schema, spec, meta)
    params = _unique_params(schema, spec, meta)
    while True:
        cur = await conn.execute(render(_meta(enqueue.JOB_INSERT_UNIQUE, meta), schema), params)
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), True
        cur = await conn.execute(render(enqueue.JOB_FIND_UNIQUE, schema), params)
        row = await cur.fetchone()
        if row is not None:
            return int(row[0]), False


def _many_unique_params(specs: Sequence[JobSpec], meta: str | None = None) -> dict[str, Any]:
    return {
        "queues": [s.queue for s in specs],
        "tasks": [s.task for s in specs],
        "args": [s.args_json for s in specs],
        "priorities": [s.priority for s in specs],
        "run_ats": [s.run_at for s in specs],
        "delays": [s.delay for s in specs],
        "max_attempts": [s.max_attempts for s in specs],
        "unique_keys": [s.unique_key if s.unique_scope == "active" else None for s in specs],
        "unique_queued_keys": [s.unique_key if s.unique_scope == "queued" else None for s in specs],
        "ordering_keys": [s.ordering_key for s in specs],
        "key_limits": [s.key_limit for s in specs],
        "key_rates": [s.key_rate[0] if s.key_rate else None for s in specs],
        "key_periods": [s.key_rate[1] if s.key_rate else None for s in specs],
        "meta": meta,
    }


UniqueKey = tuple[str, str]  # (scope, key): the same key in both scopes is two keys


def _inserted_by_key(
    specs: Sequence[JobSpec], rows: Sequence[Sequence[Any]]
) -> tuple[dict[UniqueKey, int], list[int], dict[str, list[str]]]:
    """From (id, active key, queued key) rows: ids by (scope, key), ids of plain jobs in
    insert order, and per scope the keys not inserted (duplicates, whose holders must be
    looked up)."""
    by_key: dict[UniqueKey, int] = {}
    plain: list[int] = []
    for job_id, active, queued in rows:
        if active is not None:
            by_key[("active", str(active))] = int(job_id)
        if queued is not None:
            by_key[("queued", str(queued))] = int(job_id)
        if active is None and queued is None:
            plain.append(int(job_id))
    missing: dict[str, list[str]] = {"active": [], "queued": []}
    for spec in specs:
        key = spec.unique_key
        if key and (spec.unique_scope, key) not in by_key and key not in missing[spec.unique_scope]:
            missing[spec.unique_scope].append(key)
    return by_key, plain, missing


def _ids_in_order(
    specs: Sequence[JobSpec], by_key: dict[UniqueKey, int], plain: list[int]
) -> list[int]:
    plain_iter = iter(plain)
    return [
        by_key[(spec.unique_scope, spec.unique_key)] if spec.unique_key else next(plain_iter)
        for spec in specs
    ]


def _unresolved(specs: Sequence[JobSpec], by_key: dict[UniqueKey, int]) -> list[JobSpec]:
    """The unique jobs whose key has neither a new job nor a holder: the holder left its
    scope between the insert and the look-up. One per key, to be inserted again."""
    again: dict[UniqueKey, JobSpec] = {}
    for spec in specs:
        if spec.unique_key:
            key = (spec.unique_scope, spec.unique_key)
            if key not in by_key and key not in again:
                again[key] = spec
    return list(again.values())


def _insert_unique_many(
    conn: Conn, schema: str, specs: Sequence[JobSpec], meta: str | None
) -> list[int]:
    """Unique jobs (and any others in the same batch) in one INSERT ... ON CONFLICT; the
    ids of duplicates are their holders'. A holder that left its scope before it was looked
    up frees its key: its jobs are inserted again, as insert_job does. Order follows
    ``specs``."""
    by_key: dict[UniqueKey, int] = {}
    plain: list[int] = []
    batch: Sequence[JobSpec] = specs
    while batch:
        rows = conn.execute(
            render(_meta(enqueue.JOB_INSERT_MANY_UNIQUE, meta), schema),
            _many_unique_params(batch, meta),
        ).fetchall()
        inserted, new_plain, missing = _inserted_by_key(batch, rows)
        by_key.update(inserted)
        plain.extend(new_plain)
        if missing["active"] or missing["queued"]:
            found = conn.execute(
                render(enqueue.JOB_FIND_UNIQUE_MANY, schema),
                {"keys": missing["active"], "queued_keys": missing["queued"]},
            ).fetchall()
            by_key.update(_inserted_by_key(batch, found)[0])
        batch = _unresolved(specs, by_key)
    return _ids_in_order(specs, by_key, plain)


async def _insert_unique_many_async(
    conn: AsyncConn, schema: str, specs: Sequence[JobSpec], meta: str | None
) -> list[int]:
    by_key: dict[UniqueKey, int] = {}
    plain: list[int] = []
    batch: Sequence[JobSpec] = specs
    while batch:
        cur = await conn.execute(
            render(_meta(enqueue.JOB_INSERT_MANY_UNIQUE, meta), schema),
            _many_unique_params(batch, meta),
        )
        inserted, new_plain, missing = _inserted_by_key(batch, await cur.fetchall())
        by_key.update(inserted)
        plain.extend(new_plain)
        if missing["active"] or missing["queued"]:
            cur = await conn.execute(
                render(enqueue.JOB_FIND_UNIQUE_MANY, schema),
                {"keys": missing["active"], "queued_keys": missing["queued"]},
            )
            by_key.update(_inserted_by_key(batch, await cur.fetchall())[0])
        batch = _unresolved(specs, by_key)
    return _ids_in_order(specs, by_key, plain)


@_needs_schema
def insert_jobs(
    conn: Conn, schema: str, specs: Sequence[JobSpec], *, meta: str | None = None
) -> list[int]:
    """COPY, with the ids read back: three round trips for any number of jobs. A batch with unique
    jobs goes through INSERT ... ON CONFLICT instead (COPY cannot skip duplicates).
    ``meta`` is stored with every job of the batch."""
    if not specs:
        return []
    if any(s.unique_window is not None for s in specs):
        # Windows are taken key by key: one round trip or more per job.
        return [insert_job(conn, schema, spec, meta=meta)[0] for spec in specs]
    if any(s.unique_key for s in specs):
        return _insert_unique_many(conn, schema, specs, meta)
    # Three statements that must meet one session (currval), which only a transaction
    # guarantees behind a transaction-mode pooler; the caller's, if it has one.
    with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        row = conn.execute(render(enqueue.JOB_COPY_BEGIN, schema), _table_params(schema)).fetchone()
        assert row is not None
        now, after = row
        keyed = any(s.ordering_key for s in specs)
        statement = _meta(enqueue.JOB_COPY_IN_KEYED if keyed else enqueue.JOB_COPY_IN, meta)
        with conn.cursor().copy(render(statement, schema)) as copy:
            for chunk in _copy_chunks(specs, now, keyed=keyed, meta=meta):
                copy.write(chunk)
        rows = conn.execute(
            render(enqueue.JOB_COPY_IDS, schema), {**_table_params(schema), "after": after}
        ).fetchall()
    return _copied_ids(rows, len(specs))


@_needs_schema_async
async def insert_jobs_async(
    conn: AsyncConn, schema: str, specs: Sequence[JobSpec], *, meta: str | None = None
) -> list[int]:
    if not specs:
        return []
    if any(s.unique_window is not None for s in specs):
        return [(await insert_job_async(conn, schema, spec, meta=meta))[0] for spec in specs]
    if any(s.unique_key for s in specs):
        return await _insert_unique_many_async(conn, schema, specs, meta)
    async with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        cur = await conn.execute(render(enqueue.JOB_COPY_BEGIN, schema), _table_params(schema))
        row = await cur.fetchone()
        assert row is not None
        now, after = row
        keyed = any(s.ordering_key for s in specs)
        statement = _meta(enqueue.JOB_COPY_IN_KEYED if keyed else enqueue.JOB_COPY_IN, meta)
        async with conn.cursor().copy(render(statement, schema)) as copy:
            for chunk in _copy_chunks(specs, now, keyed=keyed, meta=meta):
                await copy.write(chunk)
        cur = await conn.execute(
            render(enqueue.JOB_COPY_IDS, schema), {**_table_params(schema), "after": after}
        )
        rows = await cur.fetchall()
    return _copied_ids(rows, len(specs))


def job_from_row(row: dict[str, Any]) -> Job:
    return Job(
        id=row["id"],
        queue=row["queue"],
        task=row["task"],
        args=row["args"],
        state=JobState(row["state"]),
        priority=row["priority"],
        run_at=row["run_at"],
        retry_at=row["retry_at"],
        attempts=row["attempts"],
        max_attempts=row["max_attempts"],
        errors=row["errors"],
        worker_id=row["worker_id"],
        lease_expires_at=row["lease_expires_at"],
        created_at=row["created_at"],
        attempted_at=row["attempted_at"],
        finished_at=row["finished_at"],
        result=row["result"],
        progress=row["progress"],
        cancel_requested_at=row["cancel_requested_at"],
    )


def get_job(conn: Conn, schema: str, job_id: int) -> Job:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(render(admin.JOB_GET, schema), {"id": job_id}).fetchone()
    if row is None:
        raise JobNotFoundError(f"no job with id {job_id}")
    return job_from_row(row)


async def get_job_async(conn: AsyncConn, schema: str, job_id: int) -> Job:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(render(admin.JOB_GET, schema), {"id": job_id})
        row = await cur.fetchone()
    if row is None:
        raise JobNotFoundError(f"no job with id {job_id}")
    return job_from_row(row)


def list_jobs(
    conn: Conn,
    schema: str,
    *,
    state: str | None = None,
    queue: str | None = None,
    task: str | None = None,
    older_than: float | None = None,
    limit: int = 100,
) -> list[Job]:
    """Live jobs (not history) matching every filter given; ``older_than`` in seconds."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            render(admin.JOB_LIST, schema),
            {
                "state": state,
                "queue": queue,
                "task": task,
                "older_than": older_than,
                "limit": limit,
            },
        ).fetchall()
    return [job_from_row(r) for r in rows]


def select_job_ids(
    conn: Conn,
    schema: str,
    *,
    state: str | None = None,
    queue: str | None = None,
    task: str | None = None,
    older_than: float | None = None,
) -> list[int]:
    """Ids of the live jobs a bulk retry, cancel or delete would act on."""
    rows = conn.execute(
        render(admin.JOB_SELECT_IDS, schema),
        {"state": state, "queue": queue, "task": task, "older_than": older_than},
    ).fetchall()
    return [int(r[0]) for r in rows]


def retry_jobs(conn: Conn, schema: str, ids: Sequence[int]) -> int:
    """Send dead (or waiting) jobs back to their queues with fresh attempts; running jobs
    are left alone. Returns how many moved."""
    rows = conn.execute(
        render(admin.JOB_RETRY, schema), {"ids": list(ids), "channel": notify_channel(schema)}
    ).fetchall()
    return sum(int(r[1]) for r in rows)


def cancel_jobs(conn: Conn, schema: str, ids: Sequence[int]) -> int:
    """Cancel jobs: waiting and dead ones move to history as cancelled at once; for
    running (lease-mode) ones the worker is asked to stop them, and it records the
    cancellation. Returns how many were cancelled or asked to stop."""
    waiting = conn.execute(render(admin.JOB_CANCEL_WAITING, schema), {"ids": list(ids)}).fetchall()
    running = conn.execute(
        render(admin.JOB_CANCEL_RUNNING, schema),
        {"ids": list(ids), "channel": control_channel(schema)},
    ).fetchall()
    if waiting:  # wake anyone awaiting these jobs' results
        conn.execute(render(complete.JOBS_DONE_NOTIFY, schema), {"channel": done_channel(schema)})
    return len(waiting) + len(running)


def delete_jobs(conn: Conn, schema: str, ids: Sequence[int]) -> int:
    """Remove jobs that are not running, leaving no history."""
    return len(conn.execute(render(admin.JOB_DELETE, schema), {"ids": list(ids)}).fetchall())


def _one(done: int, conn: Conn, schema: str, job_id: int, verb: str) -> None:
    if done == 0:
        job = get_job(conn, schema, job_id)  # raises JobNotFoundError when there is none
        if job.finished_at is not None:
            raise JobNotFoundError(
                f"job {job_id} has finished ({job.state}) and is in history; it cannot {verb}"
            )
        raise JobNotFoundError(f"job {job_id} is {job.state}; only jobs not running can {verb}")


def retry_job(conn: Conn, schema: str, job_id: int) -> None:
    _one(retry_jobs(conn, schema, [job_id]), conn, schema, job_id, "be retried")


def cancel_job(conn: Conn, schema: str, job_id: int) -> None:
    _one(cancel_jobs(conn, schema, [job_id]), conn, schema, job_id, "be cancelled")


def delete_job(conn: Conn, schema: str, job_id: int) -> None:
    _one(delete_jobs(conn, schema, [job_id]), conn, schema, job_id, "be deleted")


def set_queue_paused(conn: Conn, schema: str, queue: str, *, paused: bool) -> None:
    """Pause (no claims from the next one on) or resume a queue; resuming wakes workers."""
    conn.execute(render(admin.QUEUE_SET_PAUSED, schema), {"queue": queue, "paused": paused})
    if not paused:
        conn.execute(
            render(admin.QUEUE_WAKE, schema), {"queue": queue, "channel": notify_channel(schema)}
        )


def set_queue_limits(
    conn: Conn,
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
    if concurrency is not None and (
        not isinstance(concurrency, int)
        or isinstance(concurrency, bool)
        or not 1 <= concurrency <= 2**31 - 1
    ):
        raise ConfigurationError(
            f"concurrency must be an integer from 1 to {2**31 - 1}, got {concurrency!r}"
        )
    if rate is not None:
        rate = check_rate(rate)
    conn.execute(
        render(admin.QUEUE_SET_LIMITS, schema),
        {
            "queue": queue,
            "concurrency": concurrency,
            "rate": rate[0] if rate else None,
            "period": rate[1] if rate else None,
        },
    )
    conn.execute(render(admin.QUEUE_LIMITS_CHANGED, schema), {"channel": control_channel(schema)})


def list_queues(conn: Conn, schema: str) -> list[dict[str, Any]]:
    """Queues with settings: paused or limited."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(admin.QUEUE_LIST, schema)).fetchall()


def paused_queues(conn: Conn, schema: str) -> list[str]:
    return [str(r[0]) for r in conn.execute(render(admin.QUEUE_LIST_PAUSED, schema)).fetchall()]


def queue_stats(conn: Conn, schema: str) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(admin.QUEUE_STATS, schema)).fetchall()


def list_workers(conn: Conn, schema: str) -> list[dict[str, Any]]:
    # A hot standby says so at connection (in_hot_standby, PostgreSQL 14+); it cannot read
    # the leader table, so the leader is unknown there (skiplock status --read-url).
    standby = conn.info.parameter_status("in_hot_standby") == "on"
    statement = replica.WORKER_LIST_ON_STANDBY if standby else admin.WORKER_LIST
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(statement, schema)).fetchall()
