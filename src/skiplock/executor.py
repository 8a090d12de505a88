"""Running one job: call the handler, turn what happened into an outcome.

The decisions (what a failure means, how long to wait) are pure and shared by the lease
and transactional paths; the two transactional shells (async, and sync in a thread) only
execute the shared SQL around them.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import random
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from datetime import UTC, datetime
from typing import Any

import psycopg

from skiplock.app import App
from skiplock.completer import Outcome
from skiplock.config import done_channel
from skiplock.context import CancelFlag, set_current_job
from skiplock.errors import Retry, Snooze, UnknownTaskError
from skiplock.retry import RetryPolicy, decide_failure, retry_at_from
from skiplock.sql import claim, complete, render
from skiplock.types import ClaimedJob

log = logging.getLogger("skiplock.executor")

Clock = Callable[[], datetime]
MAX_TRACEBACK_CHARS = 20_000
DEFAULT_POLICY = RetryPolicy()


def utcnow() -> datetime:
    return datetime.now(UTC)


class JobTimeoutError(Exception):
    """The handler ran longer than its task's timeout."""


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ArgumentsError(Exception):
    """A job's stored arguments cannot be decoded (a row written by hand, say)."""


def claimed_from_row(row: Sequence[Any]) -> ClaimedJob:
    """The claimed row, its arguments decoded here so a bad row fails alone."""
    job_id, queue, task, args_text, priority, run_at, attempts, max_attempts, created = row
    args: dict[str, Any] = {}
    problem = None
    try:
        decoded = json.loads(args_text)
        if isinstance(decoded, dict):
            args = decoded
        else:
            problem = "arguments are not a JSON object"
    except (ValueError, RecursionError) as exc:
        problem = f"cannot decode the job's arguments: {str(exc)[:200]}"
    return ClaimedJob(
        job_id, queue, task, args, priority, run_at, attempts, max_attempts, created, problem
    )


def error_record(exc: BaseException, attempt: int, now: datetime) -> dict[str, Any]:
    """What is stored for a failed attempt: enough to debug at 3 a.m. without logs."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "attempt": attempt,
        "at": now.isoformat(),
        "type": type(exc).__qualname__,
        "message": str(exc),
        "traceback": tb[-MAX_TRACEBACK_CHARS:],
    }


def failure_outcome(
    job_id: int,
    attempt: int,
    max_attempts: int,
    policy: RetryPolicy,
    exc: BaseException,
    now: datetime,
    rng: random.Random,
) -> Outcome:
    """Retry later (with back-off, or when the handler asked) or dead; a Snooze instead
    puts the job back without counting the attempt. Pure."""
    if isinstance(exc, Snooze):
        until = retry_at_from(exc.after, now) or now
        return Outcome(job_id, attempt, snooze=True, delay=max((until - now).total_seconds(), 0))
    retry_at = retry_at_from(exc.after, now) if isinstance(exc, Retry) else None
    decision = decide_failure(
        attempt=attempt,
        max_attempts=max_attempts,
        policy=policy,
        now=now,
        rng=rng,
        retry_at=retry_at,
    )
    return Outcome(
        job_id=job_id,
        attempt=attempt,
        error=error_record(exc, attempt, now),
        dead=decision.dead,
        delay=(decision.run_at - now).total_seconds(),
    )


def encode_result(value: object) -> str | None:
    """A handler's return value as JSON; values JSON cannot hold are stored as their repr."""
    if value is None:
        return None
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps({"repr": repr(value)})


async def run_leased(
    app: App,
    job: ClaimedJob,
    threads: Executor,
    *,
    clock: Clock = utcnow,
    rng: random.Random,
    cancel: CancelFlag | None = None,
    progress: Callable[[str], None] | None = None,
    on_abandoned: Callable[[asyncio.Future[Any]], None] | None = None,
) -> Outcome:
    """Run a claimed (lease-mode) job to an outcome. Never raises, except cancellation.

    ``cancel`` is what ``skiplock.cancel_requested()`` reads inside the handler;
    ``on_abandoned`` gets the future of a sync handler left running after its timeout."""
    policy = DEFAULT_POLICY
    try:
        task = app.get_task(job.task)
        policy = task.options.retry
        if job.args_error is not None:
            raise ArgumentsError(job.args_error)
        # Each asyncio task runs in its own context copy, so this is per job.
        set_current_job(job, cancel, progress)
        if task.is_async:
            coro = task.fn(**job.args)
            result = await asyncio.wait_for(coro, task.options.timeout)
        else:
            # run_in_executor does not carry context into the thread: hand it over.
            context = contextvars.copy_context()
            loop = asyncio.get_running_loop()
            started: asyncio.Future[None] = loop.create_future()

            def call() -> Any:
                loop.call_soon_threadsafe(_resolve, started)
                return context.run(task.fn, **job.args)

            future = loop.run_in_executor(threads, call)
            # The timeout counts from when the handler starts, not while it waits for a
            # thread (one may be held by a handler abandoned after its own timeout).
            await asyncio.shield(started)
            try:
                result = await asyncio.wait_for(asyncio.shield(future), task.options.timeout)
            except TimeoutError:
                log.warning(
                    "job %s (%s) timed out; its thread cannot be stopped and is abandoned",
                    job.id,
                    job.task,
                )
                if on_abandoned is not None:
                    on_abandoned(future)
                raise
        return Outcome(job.id, job.attempts, result_json=encode_result(result))
    except TimeoutError:
        exc: BaseException = JobTimeoutError(f"{job.task} exceeded its timeout")
    except UnknownTaskError as unknown:
        log.error("job %s: %s", job.id, unknown)
        exc = unknown
    except Exception as failure:
        exc = failure
    return failure_outcome(job.id, job.attempts, job.max_attempts, policy, exc, clock(), rng)


def _transactional_step(
    app: App,
    job: ClaimedJob,
    exc: BaseException | None,
    result: object,
    now: datetime,
    rng: random.Random,
) -> tuple[str, dict[str, Any]]:
    """The statement that records a transactional job's outcome, and its parameters."""
    attempt = job.attempts + 1
    if exc is None:
        return render(complete.JOB_COMPLETE_LOCKED, app.schema), {
            "id": job.id,
            "result": encode_result(result),
        }
    policy = app.tasks[job.task].options.retry
    outcome = failure_outcome(job.id, attempt, job.max_attempts, policy, exc, now, rng)
    if outcome.snooze:
        return render(complete.JOB_SNOOZE_LOCKED, app.schema), {
            "id": job.id,
            "delay": outcome.delay,
        }
    return render(complete.JOB_FAIL_LOCKED, app.schema), {
        "id": job.id,
        "dead": outcome.dead,
        "delay": outcome.delay,
        "error": json.dumps(outcome.error),
    }


def _kind(statement: str, params: dict[str, Any]) -> str:
    """The outcome word (as Outcome.kind) of a transactional step, for metrics."""
    if "error" in params:
        return "dead" if params["dead"] else "retried"
    return "completed" if "result" in params else "snoozed"


def _done_notify(app: App) -> tuple[str, dict[str, Any]]:
    return render(complete.JOBS_DONE_NOTIFY, app.schema), {"channel": done_channel(app.schema)}


def _lock_params(queue: str, tasks: Sequence[str], limit: int) -> dict[str, Any]:
    return {"queue": queue, "tasks": list(tasks), "limit": limit}


async def run_transactional_async(
    app: App,
    conn: psycopg.AsyncConnection[Any],
    queue: str,
    tasks: Sequence[str],
    limit: int,
    *,
    rng: random.Random,
    clock: Clock = utcnow,
    on_claimed: Callable[[int], None] = lambda n: None,
    on_finished: Callable[[ClaimedJob, str, float], None] = lambda job, kind, seconds: None,
) -> int:
    """Claim, run and record up to ``limit`` async transactional jobs in one transaction.

    Each job runs in a savepoint: a failing handler's writes roll back while the failure
    itself is recorded in the outer transaction. Returns how many jobs were claimed.
    """
    async with conn.transaction():
        # The handler's own writes commit with the job: they must be durable.
        await conn.execute(render(complete.DURABLE_COMMIT_ON, app.schema))
        cur = await conn.execute(
            render(claim.JOB_LOCK_BATCH, app.schema), _lock_params(queue, tasks, limit)
        )
        jobs = [claimed_from_row(r) for r in await cur.fetchall()]
        on_claimed(len(jobs))
        for job in jobs:
            task = app.tasks[job.task]
            exc: BaseException | None = None
            result: object = None
            set_current_job(job)
            started = time.perf_counter()
            try:
                if job.args_error is not None:
                    raise ArgumentsError(job.args_error)
                async with conn.transaction():
                    result = await asyncio.wait_for(task.fn(conn, **job.args), task.options.timeout)
            except TimeoutError:
                exc = JobTimeoutError(f"{job.task} exceeded its timeout")
            except Exception as failure:
                exc = failure
            set_current_job(None)
            statement, params = _transactional_step(app, job, exc, result, clock(), rng)
            await conn.execute(statement, params)
            on_finished(job, _kind(statement, params), time.perf_counter() - started)
        if jobs:
            await conn.execute(*_done_notify(app))
    return len(jobs)


def run_transactional_sync(
    app: App,
    conn: psycopg.Connection[Any],
    queue: str,
    tasks: Sequence[str],
    limit: int,
    *,
    rng: random.Random,
    clock: Clock = utcnow,
    on_claimed: Callable[[int], None] = lambda n: None,
    on_finished: Callable[[ClaimedJob, str, float], None] = lambda job, kind, seconds: None,
) -> int:
    """Sync twin of ``run_transactional_async``, run in a worker thread."""
    with conn.transaction():
        rows = conn.execute(
            render(claim.JOB_LOCK_BATCH, app.schema), _lock_params(queue, tasks, limit)
        ).fetchall()
        jobs = [claimed_from_row(r) for r in rows]
        on_claimed(len(jobs))
        for job in jobs:
            task = app.tasks[job.task]
            exc: BaseException | None = None
            result: object = None
            set_current_job(job)
            started = time.perf_counter()
            if task.options.timeout is not None:
                ms = str(max(int(task.options.timeout * 1000), 1))
                conn.execute(render(complete.SESSION_LIMIT, app.schema), {"ms": ms})
            try:
                if job.args_error is not None:
                    raise ArgumentsError(job.args_error)
                with conn.transaction():
                    result = task.fn(conn, **job.args)
            except Exception as failure:
                exc = failure
            set_current_job(None)
            statement, params = _transactional_step(app, job, exc, result, clock(), rng)
            conn.execute(statement, params)
            on_finished(job, _kind(statement, params), time.perf_counter() - started)
        if jobs:
            conn.execute(*_done_notify(app))
    return len(jobs)
