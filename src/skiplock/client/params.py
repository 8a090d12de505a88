"""What the client sends and reads back, decided without a connection: statement
parameters, COPY text, job rows, and the checks of admin arguments. The I/O shells in
``database_async`` (and its generated sync twin ``database``) only execute."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

import psycopg

from skiplock.errors import (
    ConfigurationError,
    JobNotFoundError,
    ScheduleNotFoundError,
    SchemaNotReadyError,
)
from skiplock.sql import enqueue
from skiplock.tasks import JobSpec, check_rate
from skiplock.types import Job, JobState

# Enqueueing before `skiplock migrate` reaches a schema or table that is not there; the
# error names the command instead of leaving a bare UndefinedTable.
SCHEMA_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)

# Bulk enqueue writes COPY's text format itself, a few thousand rows per write: psycopg's
# write_row formats each value of each row (2.6 us a job), and separate writes let the
# server take in one chunk while the next is built.
COPY_CHUNK_ROWS = 2000
COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})

UniqueKey = tuple[str, str]  # (scope, key): the same key in both scopes is two keys


class JobFilters(TypedDict, total=False):
    """The filters of the admin listings of live jobs (sql/admin.py, JOB_LIST and
    JOB_SELECT_IDS); one not given, or None, filters nothing."""

    state: str | None
    queue: str | None
    task: str | None
    older_than: float | None  # seconds since the job was enqueued
    tag: str | None  # jobs with this tag among theirs


def filter_params(filters: Mapping[str, object]) -> dict[str, object]:
    """Every filter's statement parameter, None where not given. A name that is no filter
    is a TypeError, as it was when the filters were keyword parameters of their own."""
    names = JobFilters.__annotations__
    unknown = [name for name in filters if name not in names]
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    values = {name: filters.get(name) for name in names}
    # The tag as a JSON array, a constant the planner weighs with the tags' statistics
    # (0032); built in SQL it would be a function call, estimated blind.
    values["tag_json"] = tag_json(values["tag"])
    return values


def tag_json(tag: object) -> str | None:
    return None if tag is None else json.dumps([tag])


def schema_not_ready(schema: str, exc: psycopg.Error) -> SchemaNotReadyError:
    return SchemaNotReadyError(
        f"skiplock's tables are not in schema {schema!r} of this database "
        f"({str(exc).strip().splitlines()[0]}): run `skiplock migrate` first"
    )


def one_params(spec: JobSpec, meta: str | None = None) -> dict[str, Any]:
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


def copy_field(value: object) -> str:
    """``value`` in COPY's text format: None is \\N; a backslash, tab or line break in
    text is escaped, so that a job's own text can never end its field or row."""
    if value is None:
        return "\\N"
    text = str(value)
    if "\\" in text or "\t" in text or "\n" in text or "\r" in text:
        return text.translate(COPY_ESCAPES)
    return text


def copy_chunks(
    specs: Sequence[JobSpec],
    now: datetime,
    *,
    keyed: bool = False,
    meta: str | None = None,
) -> Iterator[str]:
    """COPY text for JOB_COPY_IN (JOB_COPY_IN_KEYED when ``keyed``), COPY_CHUNK_ROWS rows
    at a time: run_at and state decided against the transaction's now(). When the batch
    stores a meta (``meta`` given, or a job with tags), every row ends with its own (the
    _META statements)."""
    tagged = any(spec.tags for spec in specs)
    meta_field = None if meta is None and not tagged else copy_field(meta)
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
            due[when] = (copy_field(run_at), run_at > now)
        run_at_text, later = due[when]
        if spec.ordering_key is not None:
            state = "blocked"
        else:
            state = "scheduled" if later else "available"
        queue = names.get(spec.queue) or names.setdefault(spec.queue, copy_field(spec.queue))
        task = names.get(spec.task) or names.setdefault(spec.task, copy_field(spec.task))
        line = (
            f"{queue}\t{task}\t{copy_field(spec.args_json)}\t{spec.priority}\t"
            f"{run_at_text}\t{state}\t{spec.max_attempts}"
        )
        if keyed:
            rate, period = spec.key_rate or (None, None)
            line = (
                f"{line}\t{copy_field(spec.ordering_key)}\t{spec.key_limit}\t"
                f"{copy_field(rate)}\t{copy_field(period)}"
            )
        if meta_field is not None:
            own = copy_field(job_meta(spec, meta)) if spec.tags else meta_field
            line = f"{line}\t{own}"
        lines.append(line)
        if len(lines) == COPY_CHUNK_ROWS:
            lines.append("")
            yield "\n".join(lines)
            lines = []
    if lines:
        lines.append("")
        yield "\n".join(lines)


def with_meta(statement: str, meta: str | None, specs: Sequence[JobSpec] = ()) -> str:
    """The statement, or its twin that also writes the jobs' meta when there is one (the
    batch's ``meta``, or tags of one of ``specs``)."""
    if meta is None and not any(spec.tags for spec in specs):
        return statement
    return enqueue.WITH_META[statement]


def tags_of(value: object) -> tuple[str, ...]:
    """The tags in a row's meta (written by hand, perhaps): its strings, nothing else."""
    if not isinstance(value, list):
        return ()
    return tuple(tag for tag in value if isinstance(tag, str))


def job_meta(spec: JobSpec, meta: str | None) -> str | None:
    """The job's meta: the batch's (a trace context), with the job's tags when it has any."""
    if not spec.tags:
        return meta
    own: dict[str, Any] = {} if meta is None else json.loads(meta)
    return json.dumps({**own, "tags": list(spec.tags)}, separators=(",", ":"))


def table_params(schema: str) -> dict[str, Any]:
    return {"table": f'"{schema}".jobs'}


def copied_ids(rows: Sequence[Sequence[Any]], count: int) -> list[int]:
    """The ids JOB_COPY_IDS found, which must be one per job sent."""
    ids = [int(row[0]) for row in rows]
    if len(ids) != count:  # pragma: no cover - a broken invariant, never a user's error
        raise RuntimeError(f"bulk enqueue copied {count} jobs but found {len(ids)} ids")
    return ids


def unique_params(schema: str, spec: JobSpec, meta: str | None = None) -> dict[str, Any]:
    active = spec.unique_key if spec.unique_scope == "active" else None
    queued = spec.unique_key if spec.unique_scope == "queued" else None
    return {
        **one_params(spec, meta),
        "unique_key": active,
        "unique_queued_key": queued,
        "replace": list(spec.replace),
    }


def window_params(schema: str, spec: JobSpec) -> dict[str, Any]:
    return {
        "table": f'"{schema}".jobs',
        "unique_key": spec.unique_key,
        "window": spec.unique_window,
    }


def many_unique_params(specs: Sequence[JobSpec], meta: str | None = None) -> dict[str, Any]:
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
        "metas": [job_meta(s, meta) for s in specs],
    }


def inserted_by_key(
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


def ids_in_order(
    specs: Sequence[JobSpec], by_key: dict[UniqueKey, int], plain: list[int]
) -> list[int]:
    plain_iter = iter(plain)
    return [
        by_key[(spec.unique_scope, spec.unique_key)] if spec.unique_key else next(plain_iter)
        for spec in specs
    ]


def unresolved(specs: Sequence[JobSpec], by_key: dict[UniqueKey, int]) -> list[JobSpec]:
    """The unique jobs whose key has neither a new job nor a holder: the holder left its
    scope between the insert and the look-up. One per key, to be inserted again."""
    again: dict[UniqueKey, JobSpec] = {}
    for spec in specs:
        if spec.unique_key:
            key = (spec.unique_scope, spec.unique_key)
            if key not in by_key and key not in again:
                again[key] = spec
    return list(again.values())


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
        wait_key=row.get("wait_key"),
        wait_until=row.get("wait_until"),
        tags=tags_of(row.get("tags")),
    )


def not_changed(job: Job, verb: str) -> JobNotFoundError:
    """Why an admin change of one job touched no row: it has finished (and is in
    history), or it is running."""
    if job.finished_at is not None:
        again = " (retry runs a completed or cancelled one again)" if verb == "be retried" else ""
        return JobNotFoundError(
            f"job {job.id} has finished ({job.state}) and is in history; it cannot {verb}{again}"
        )
    return JobNotFoundError(f"job {job.id} is {job.state}; only jobs not running can {verb}")


def limits_params(
    queue: str, concurrency: int | None, rate: tuple[int, float] | str | None
) -> dict[str, Any]:
    """QUEUE_SET_LIMITS' parameters, the limits checked: ``concurrency`` from 1 to
    2**31 - 1, ``rate`` = (jobs, seconds) or "100/s"; None removes a limit."""
    if concurrency is not None and (
        not isinstance(concurrency, int)
        or isinstance(concurrency, bool)
        or not 1 <= concurrency <= 2**31 - 1
    ):
        raise ConfigurationError(
            f"concurrency must be an integer from 1 to {2**31 - 1}, got {concurrency!r}"
        )
    checked = check_rate(rate) if rate is not None else None
    return {
        "queue": queue,
        "concurrency": concurrency,
        "rate": checked[0] if checked else None,
        "period": checked[1] if checked else None,
    }


def no_schedule(name: str) -> ScheduleNotFoundError:
    return ScheduleNotFoundError(
        f"no cron schedule {name!r}: `skiplock cron list` shows those workers have ticked"
    )


def schedule_job(row: Mapping[str, Any]) -> JobSpec:
    """The job a schedule's description (PERIODIC_LIST's row) enqueues. A schedule last
    ticked by a worker from before migration 0030 has none yet: its next pass writes it."""
    if row["task"] is None:
        raise ScheduleNotFoundError(
            f"cron schedule {row['name']!r} has no description yet: a worker that runs it "
            "writes one at its next pass"
        )
    # A row written by hand may leave the rest out: the jobs table's own defaults then.
    return JobSpec(
        task=row["task"],
        args_json=json.dumps(row["args"] or {}),
        queue=row["queue"] or "default",
        priority=row["priority"] or 0,
        max_attempts=row["max_attempts"] or 3,
        tags=tags_of(row.get("tags")),
    )
