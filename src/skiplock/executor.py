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
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager, suppress
from dataclasses import KW_ONLY, dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import psycopg

from skiplock.app import App
from skiplock.config import done_channel, results_notice
from skiplock.context import CancelFlag, set_current_job
from skiplock.durable import LockedStore, StepStore, set_step_store
from skiplock.errors import (
    AttemptSuspended,
    OutcomeNotStorableError,
    Retry,
    Snooze,
    UnknownTaskError,
)
from skiplock.outcomes import Completed, Outcome, Snoozed, Suspended, failed, locked_write
from skiplock.retry import RetryPolicy, decide_failure, retry_at_from
from skiplock.sql import claim, complete, render
from skiplock.storable import encode_result, storable_message, storable_text
from skiplock.tasks import Task
from skiplock.tracebacks import format_handler_exception
from skiplock.tracing import Tracing
from skiplock.types import ClaimedJob

log = logging.getLogger("skiplock.executor")

Clock = Callable[[], datetime]
# Told of each transactional job's end: the job, its outcome, and the seconds it took.
Finished = Callable[[ClaimedJob, Outcome, float], None]
MAX_TRACEBACK_CHARS = 20_000
DEFAULT_POLICY = RetryPolicy()
# The furthest a handler may put its job off (Retry/Snooze after=...): past this the
# request is refused as a mistake, and timestamps stay well inside what Python and
# PostgreSQL both read back.
MAX_REQUESTED_DELAY = timedelta(days=100 * 366)


def utcnow() -> datetime:
    return datetime.now(UTC)


class JobTimeoutError(Exception):
    """The handler ran longer than its task's timeout."""


class SessionLostError(Exception):
    """A transactional job's session ended while it ran; its attempt is counted anyway."""


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ArgumentsError(Exception):
    """A job's stored arguments cannot be decoded (a row written by hand, say)."""


def claimed_from_row(row: Sequence[Any]) -> ClaimedJob:
    """The claimed row, its arguments decoded here so a bad row fails alone. A tenth
    column, when there is one, is the job's meta, left as text for a tracer to read."""
    job_id, queue, task, args_text, priority, run_at, attempts, max_attempts, created = row[:9]
    args: dict[str, Any] = {}
    problem = None
    if args_text != "{}":  # no arguments (jsonb prints an empty object so): nothing to decode
        try:
            decoded = json.loads(args_text)
            if isinstance(decoded, dict):
                args = decoded
            else:
                problem = "arguments are not a JSON object"
        except (ValueError, RecursionError) as exc:
            problem = f"cannot decode the job's arguments: {str(exc)[:200]}"
    return ClaimedJob(
        job_id,
        queue,
        task,
        args,
        priority,
        run_at,
        attempts,
        max_attempts,
        created,
        problem,
        row[9] if len(row) > 9 else None,
    )


def error_record(exc: BaseException, attempt: int, now: datetime) -> dict[str, Any]:
    """What is stored for a failed attempt: enough to debug at 3 a.m. without logs.

    Every string is made storable (skiplock.storable): a message with a NUL or a lone
    surrogate in it must not cost the job its record, nor its batch the write."""
    try:
        tb = format_handler_exception(exc)
    except Exception as broken:  # a user's exception may break even this
        tb = f"<traceback could not be formatted: {type(broken).__qualname__}>"
    return {
        "attempt": attempt,
        "at": now.isoformat(),
        "type": storable_text(type(exc).__qualname__),
        "module": storable_text(type(exc).__module__),
        "message": storable_message(exc),
        "traceback": storable_text(tb[-MAX_TRACEBACK_CHARS:]),
    }


def requested_time(after: object, now: datetime, asked_by: str) -> datetime:
    """The time a handler's ``Retry(after=...)`` or ``Snooze(after=...)`` names, checked.

    A delay that is not finite, a time past MAX_REQUESTED_DELAY, or anything that is not
    a time at all raises OutcomeNotStorableError naming the value; a time in the past is
    "now" (the callers take the later of it and now)."""
    try:
        at = retry_at_from(after, now)  # type: ignore[arg-type]
        if at is None:
            return now
        delay = (at - now).total_seconds()
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise OutcomeNotStorableError(
            f"{asked_by}(after={storable_message(repr(after))}) is not a usable time: "
            f"{storable_message(exc)}"
        ) from None
    if not math.isfinite(delay) or delay > MAX_REQUESTED_DELAY.total_seconds():
        raise OutcomeNotStorableError(
            f"{asked_by}(after={storable_message(repr(after))}) is out of range: a job can "
            f"be put off by at most {MAX_REQUESTED_DELAY.days} days"
        )
    return at


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
    puts the job back without counting the attempt. Pure.

    A Retry or Snooze asking for a time that cannot be (inf, nan, centuries ahead) is a
    failed attempt recorded with that reason, retried with the policy's back-off."""
    retry_at = None
    try:
        if isinstance(exc, Snooze):
            until = max(requested_time(exc.after, now, "Snooze"), now)
            return Snoozed(job_id, attempt, delay=(until - now).total_seconds())
        if isinstance(exc, Retry):
            retry_at = requested_time(exc.after, now, "Retry")
    except OutcomeNotStorableError as refused:
        refused.__cause__ = exc
        exc, retry_at = refused, None
    decision = decide_failure(
        attempt=attempt,
        max_attempts=max_attempts,
        policy=policy,
        now=now,
        rng=rng,
        retry_at=retry_at,
    )
    return failed(
        job_id,
        attempt,
        error_record(exc, attempt, now),
        dead=decision.dead,
        delay=(decision.run_at - now).total_seconds(),
    )


def last_resort_outcome(
    job: ClaimedJob, attempt: int, problem: BaseException, now: datetime, rng: random.Random
) -> Outcome:
    """The outcome of an attempt whose own outcome could not be made (failure_outcome or
    encode_result raised): a failed attempt whose record says what went wrong. Built from
    values known to be storable, with the default back-off, so it cannot fail in turn."""
    dead = attempt >= job.max_attempts
    return failed(
        job.id,
        attempt,
        {
            "attempt": attempt,
            "at": now.isoformat(),
            "type": "OutcomeNotStorableError",
            "message": "outcome not storable: "
            + storable_text(f"{type(problem).__qualname__}: {storable_message(problem)}"),
            "traceback": None,
        },
        dead=dead,
        delay=0.0 if dead else DEFAULT_POLICY.delay(attempt, rng),
    )


async def run_leased(
    app: App,
    job: ClaimedJob,
    threads: Executor,
    *,
    clock: Clock = utcnow,
    rng: random.Random,
    cancel: CancelFlag | None = None,
    progress: Callable[[str], None] | None = None,
    steps: StepStore | None = None,
    completing: Callable[[], None] | None = None,
    on_abandoned: Callable[[asyncio.Future[Any]], None] | None = None,
) -> Outcome:
    """Run a claimed (lease-mode) job to an outcome. Never raises, except cancellation.

    ``cancel`` is what ``skiplock.cancel_requested()`` reads inside the handler,
    ``steps`` where ``skiplock.step()`` records, ``completing`` called when the handler
    completes the job in its own transaction (``skiplock.complete``);
    ``on_abandoned`` gets the future of a sync handler left running after its timeout."""
    policy = DEFAULT_POLICY
    try:
        task = app.get_task(job.task)
        policy = task.options.retry
        if job.args_error is not None:
            raise ArgumentsError(job.args_error)
        # Each asyncio task runs in its own context copy, so this is per job.
        set_current_job(job, cancel, progress)
        set_step_store(steps, completing, app.tracing)  # skiplock.step(), complete(), ...
        result = await _call_leased(task, job, threads, on_abandoned)
        # Inside the try: a value PostgreSQL cannot store fails this attempt, here.
        return Completed(job.id, job.attempts, encode_result(result))
    except AttemptSuspended as suspended:  # its handler wrote that it waits or sleeps
        return Suspended(job.id, job.attempts, suspended.kind)
    except JobTimeoutError as timed_out:
        exc: BaseException = timed_out.with_traceback(None)  # its frames are skiplock's
    except UnknownTaskError as unknown:
        log.error("job %s: %s", job.id, unknown)
        exc = unknown
    except Exception as failure:
        exc = failure
    now = clock()
    try:
        return failure_outcome(job.id, job.attempts, job.max_attempts, policy, exc, now, rng)
    except Exception as problem:
        # The job's task must end with an outcome whatever the exception holds.
        log.exception("job %s: its failure could not be recorded as raised", job.id)
        return last_resort_outcome(job, job.attempts, problem, now, rng)


async def _call_leased(
    task: Task[Any],
    job: ClaimedJob,
    threads: Executor,
    on_abandoned: Callable[[asyncio.Future[Any]], None] | None,
) -> Any:
    """The handler's return value: awaited (async), or from a worker thread (sync),
    within the task's timeout."""
    timeout = task.options.timeout
    if task.is_async:
        coro = task.fn(**job.args)
        return await (coro if timeout is None else within_timeout(job, coro, timeout))
    # run_in_executor does not carry context into the thread: hand it over.
    call = partial(contextvars.copy_context().run, _carrying_timeouts, task.fn, job.args)
    try:
        if timeout is None:
            # No timeout to count: no word back from the thread when the handler starts,
            # which would wake the event loop once more per job.
            return await asyncio.get_running_loop().run_in_executor(threads, call)
        return await _in_thread_timed(job, call, threads, timeout, on_abandoned)
    except _ThreadTimeoutError as carried:
        raise carried.error from None


class _ThreadTimeoutError(Exception):
    """A sync handler's own TimeoutError, carried out of its thread: asyncio re-creates a
    concurrent.futures TimeoutError (which TimeoutError is) from its arguments alone,
    dropping the traceback that says where the handler raised it."""

    def __init__(self, error: TimeoutError) -> None:
        super().__init__(error)
        self.error = error


def _carrying_timeouts(fn: Callable[..., Any], args: dict[str, Any]) -> Any:
    try:
        return fn(**args)
    except TimeoutError as exc:
        raise _ThreadTimeoutError(exc) from None


async def _in_thread_timed(
    job: ClaimedJob,
    call: Callable[[], Any],
    threads: Executor,
    timeout: float,
    on_abandoned: Callable[[asyncio.Future[Any]], None] | None,
) -> Any:
    """A sync handler's ``call`` in a thread, its timeout counted from when it starts,
    not while it waits for a thread (one may be held by a handler abandoned after its
    own timeout). At the timeout the thread, which cannot be stopped, is abandoned."""
    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()

    def run() -> Any:
        loop.call_soon_threadsafe(_resolve, started)
        return call()

    future = loop.run_in_executor(threads, run)
    await asyncio.shield(started)
    try:
        return await within_timeout(job, asyncio.shield(future), timeout)
    except JobTimeoutError:
        log.warning(
            "job %s (%s) timed out; its thread cannot be stopped and is abandoned",
            job.id,
            job.task,
        )
        if on_abandoned is not None:
            on_abandoned(future)
        raise


async def within_timeout(job: ClaimedJob, awaitable: Awaitable[Any], timeout: float) -> Any:
    """``awaitable``'s result, or JobTimeoutError once the task's ``timeout`` has passed
    (the awaitable is cancelled). A TimeoutError the handler raises itself (a socket's,
    an inner wait_for's) is its own failure and goes out as it was raised."""
    window = asyncio.timeout(timeout)
    try:
        async with window:
            return await awaitable
    except TimeoutError:
        if window.expired():
            raise JobTimeoutError(f"{job.task} exceeded its timeout") from None
        raise


# -- transactional mode ---------------------------------------------------------------
#
# Each job runs in a savepoint that holds its handler's writes and, when it returns, the
# write of its completion: a result PostgreSQL cannot store (or any refused completion)
# fails the job and rolls its writes back. A failure is written in a savepoint of its own;
# if even that is refused, a plain failure naming the reason is written instead. And if
# the session itself ends while a job runs (the server ending a stuck handler, a DBA, a
# network cut), that job's attempt is counted from another session (decision 002): no
# job can roll back its own attempts forever. A worker's stop (BatchStop) starts no
# further job of a batch and commits what finished, a job cut short at the deadline aside.

# A statement and its parameters, written in the attempt's transaction.
Statement = tuple[str, dict[str, Any]]


def _completion(job: ClaimedJob, result: object) -> Completed:
    """A transactional job's completion; raises ResultNotStorableError."""
    return Completed(job.id, job.attempts + 1, encode_result(result))


def _failure(
    app: App, job: ClaimedJob, exc: BaseException, now: datetime, rng: random.Random
) -> Outcome:
    """A transactional job's failed attempt (or its snooze)."""
    attempt = job.attempts + 1
    try:
        policy = app.tasks[job.task].options.retry
        return failure_outcome(job.id, attempt, job.max_attempts, policy, exc, now, rng)
    except Exception as problem:
        log.exception("job %s: its failure could not be recorded as raised", job.id)
        return last_resort_outcome(job, attempt, problem, now, rng)


def _refused(job: ClaimedJob, refused: BaseException, now: datetime, rng: random.Random) -> Outcome:
    """The failure written when the failure itself was refused: storable by construction."""
    return last_resort_outcome(job, job.attempts + 1, refused, now, rng)


def _charge_statement(
    app: App, job: ClaimedJob, reason: str, now: datetime, rng: random.Random
) -> Statement:
    """The statement counting the attempt a lost session took with it (decision 002)."""
    attempt = job.attempts + 1
    error = SessionLostError(storable_text(reason))
    try:
        delay = app.tasks[job.task].options.retry.delay(attempt, rng)
    except Exception:  # an unknown task: it fails on its next run anyway
        delay = DEFAULT_POLICY.delay(attempt, rng)
    record = error_record(error, attempt, now)
    record["traceback"] = None
    return render(complete.JOB_CHARGE_LOST_ATTEMPT, app.schema), {
        "id": job.id,
        "attempts": job.attempts,
        "delay": delay,
        "error": json.dumps(record),
    }


def _lost_reason(exc: BaseException) -> str:
    return (
        "the job's session ended while it ran, rolling back its transaction "
        f"({type(exc).__qualname__}: {storable_message(exc)}); the attempt is counted"
    )


class _TracedAttempt:
    """The process span of one transactional attempt (skiplock/tracing.py), entered and
    left by hand: the attempt is not one block of the session's loop. ``abort`` ends it
    with the exception that ended the session."""

    def __init__(self, tracing: Tracing, job: ClaimedJob) -> None:
        self._span = tracing.process(job, job.attempts + 1)
        self._process = self._span.__enter__()

    def end(self, kind: str, error: dict[str, Any] | None) -> None:
        self._process.ended(kind, error)
        self._span.__exit__(None, None, None)

    def abort(self, exc: BaseException) -> None:
        self._span.__exit__(type(exc), exc, exc.__traceback__)


def _lock_params(queue: str, tasks: Sequence[str], limit: int, governed: bool) -> dict[str, Any]:
    return {"queue": queue, "tasks": list(tasks), "limit": limit, "governed": governed}


def _limit_params(timeout: float) -> dict[str, Any]:
    ms = str(max(int(timeout * 1000), 1))
    return {"idle": ms, "statement": ms}


class CutShortError(Exception):
    """The shutdown deadline cut the running job short (BatchStop.cut)."""


_CUT_REASON = "cut short by the shutdown deadline; its writes rolled back, its attempt not counted"


class BatchStop:
    """A worker's stop as one transactional batch sees it (decision 002). The async and
    the sync session share it; they differ only in how a cut reaches a running handler.

    Once ``stopping`` is set no further job of the batch starts: the session commits what
    finished, and the jobs it did not start go back with that commit, untouched (their row
    locks were the claim; attempts are counted only by an outcome). ``cut`` is the shutdown
    deadline: the job still running is cut short, its savepoint rolled back and its attempt
    not counted (a WorkerShutdown note says so, as in lease mode), and the jobs finished
    before it commit all the same."""

    def __init__(self, stopping: threading.Event | None = None) -> None:
        self._stopping = stopping if stopping is not None else threading.Event()
        # Taken by ``cut`` for as long as its action lasts, and by the handler's start and
        # return: a sync handler that returns during a cut waits for the commit made for it.
        self._lock = threading.Lock()
        self._halted = False
        self._running: ClaimedJob | None = None
        self._on_cut: Callable[[], object] = lambda: None
        self._cut: ClaimedJob | None = None

    def jobs_to_start(self, jobs: Sequence[ClaimedJob]) -> Iterator[ClaimedJob]:
        """``jobs`` in order, until a stop is asked."""
        for index, job in enumerate(jobs):
            if self._stopped():
                self._handed_back(len(jobs) - index)
                return
            yield job

    def entered(self, job: ClaimedJob, on_cut: Callable[[], object], left: int) -> bool:
        """``job``'s handler is about to start, in its savepoint; ``on_cut`` is how a cut
        would reach it. False when a stop came since ``jobs_to_start`` let it through:
        then it does not start (with the ``left`` jobs behind it, itself included)."""
        with self._lock:
            if self._stopped():
                self._handed_back(left)
                return False
            self._running, self._on_cut = job, on_cut
            return True

    @property
    def was_cut(self) -> bool:
        return self._cut is not None

    def left(self) -> bool:
        """The handler returned or raised: True when it was cut short meanwhile."""
        with self._lock:
            self._running = None
            return self._cut is not None

    def cut(self) -> bool:
        """Cut the running handler short (the session's ``on_cut``), and start no other;
        False when none runs (the session is between jobs, and ends by itself)."""
        with self._lock:
            self._halted = True
            if self._running is None or self._cut is not None:
                return False
            self._cut = self._running
            self._on_cut()
            return True

    def _stopped(self) -> bool:
        return self._halted or self._stopping.is_set()

    @staticmethod
    def _handed_back(count: int) -> None:
        log.info("stop asked: %d jobs of the batch go back unstarted", count)


class _NotStartedError(Exception):
    """A stop came between a job's setup and its handler's start (BatchStop.entered)."""


def _shutdown_note(app: App, job: ClaimedJob) -> Statement:
    return render(complete.JOB_NOTE_SHUTDOWN_LOCKED, app.schema), {"id": job.id}


class _Batch:
    """The bookkeeping of one transactional batch, shared by the async and sync drivers:
    the job running, its span and start, the jobs finished. No I/O: each driver runs the
    statements these decide, and the handler."""

    def __init__(
        self,
        app: App,
        jobs: list[ClaimedJob],
        *,
        rng: random.Random,
        clock: Clock,
        on_finished: Finished,
    ) -> None:
        self.app, self.jobs = app, jobs
        self.rng, self.clock, self._on_finished = rng, clock, on_finished
        self.finished = 0
        self.running: ClaimedJob | None = None
        self._traced: _TracedAttempt | None = None
        self._started = 0.0

    @property
    def left(self) -> int:
        """Jobs of the batch not finished, the running one included."""
        return len(self.jobs) - self.finished

    def begin(self, job: ClaimedJob) -> None:
        """``job``'s attempt begins: it is current (skiplock.current_job) and traced."""
        self.running = job
        set_current_job(job)
        tracing = self.app.tracing
        self._traced = None if tracing is None else _TracedAttempt(tracing, job)
        self._started = time.perf_counter()

    def handler_left(self) -> None:
        """The handler returned or raised."""
        set_current_job(None)

    def failure(self, exc: BaseException) -> Outcome:
        assert self.running is not None
        return _failure(self.app, self.running, exc, self.clock(), self.rng)

    def refused(self, refusal: BaseException) -> Outcome:
        assert self.running is not None
        return _refused(self.running, refusal, self.clock(), self.rng)

    def ended(self, outcome: Outcome) -> None:
        """The running job's outcome is written (in the batch's transaction)."""
        job, self.running = self.running, None
        assert job is not None
        self.finished += 1
        if self._traced is not None:
            self._traced.end(outcome.kind, outcome.error)
            self._traced = None
        self._on_finished(job, outcome, time.perf_counter() - self._started)

    def stopped(self, reason: BaseException) -> None:
        """The running job did not run to an outcome (a stop, a cut): nothing is charged."""
        set_current_job(None)
        self.running = None
        if self._traced is not None:
            self._traced.abort(reason)
            self._traced = None

    def aborted(self, exc: BaseException) -> ClaimedJob | None:
        """The session failed with ``exc``; returns the job whose attempt it took with it."""
        if self._traced is not None:
            self._traced.abort(exc)
            self._traced = None
        return self.running


@dataclass(frozen=True)
class TransactionalRun:
    """One transactional batch, for either driver: up to ``limit`` jobs of ``tasks`` on
    ``queue``. ``governed``: the caller reserved the queue's rate (worker/limits.py); if
    not, a queue with a rate limit gives nothing. ``stop`` ends the batch early;
    ``on_claimed`` hears how many jobs the claim brought, ``on_finished`` each outcome."""

    app: App
    queue: str
    tasks: Sequence[str]
    limit: int
    _: KW_ONLY
    rng: random.Random
    governed: bool = False
    clock: Clock = utcnow
    stop: BatchStop = field(default_factory=BatchStop)
    on_claimed: Callable[[int], None] = lambda n: None
    on_finished: Finished = lambda job, outcome, seconds: None


async def run_transactional_async(conn: psycopg.AsyncConnection[Any], run: TransactionalRun) -> int:
    """Claim, run and record ``run``'s async transactional jobs in one transaction.

    Each job runs in a savepoint: a failing handler's writes roll back while the failure
    itself is recorded in the outer transaction. A cut of ``run.stop`` reaches the handler
    as a cancellation. Returns how many jobs ran to an outcome.
    """
    app, stop = run.app, run.stop
    batch: _Batch | None = None
    try:
        async with conn.transaction():
            # The handler's own writes commit with the job: they must be durable.
            await conn.execute(render(complete.DURABLE_COMMIT_ON, app.schema))
            cur = await conn.execute(
                render(claim.JOB_LOCK_BATCH, app.schema),
                _lock_params(run.queue, run.tasks, run.limit, run.governed),
            )
            jobs = [claimed_from_row(r) for r in await cur.fetchall()]
            run.on_claimed(len(jobs))
            batch = _Batch(app, jobs, rng=run.rng, clock=run.clock, on_finished=run.on_finished)
            set_step_store(
                LockedStore(conn, app.schema), tracing=app.tracing
            )  # steps commit with the batch
            for job in stop.jobs_to_start(jobs):
                batch.begin(job)
                outcome = await _attempt_async(batch, conn, job, stop)
                if outcome is None:
                    break
                batch.ended(outcome)
            if jobs:
                await conn.execute(*results_notice(app.schema))
    except Exception as exc:
        lost = None if batch is None else batch.aborted(exc)
        if lost is not None:
            await _charge_async(run, conn, lost, exc)
        raise
    assert batch is not None
    return batch.finished


async def _attempt_async(
    batch: _Batch, conn: psycopg.AsyncConnection[Any], job: ClaimedJob, stop: BatchStop
) -> Outcome | None:
    """Run ``job``'s handler in its savepoint and write its outcome; None when a stop
    came before it started or cut it short (the batch then ends)."""
    app, session = batch.app, asyncio.current_task()
    assert session is not None
    task = app.tasks[job.task]
    try:
        if job.args_error is not None:
            raise ArgumentsError(job.args_error)
        async with conn.transaction(complete.JOB_SAVEPOINT):
            if not stop.entered(job, session.cancel, batch.left):
                raise _NotStartedError
            try:
                timeout = task.options.timeout
                coro = task.fn(conn, **job.args)
                result = await (coro if timeout is None else within_timeout(job, coro, timeout))
            except asyncio.CancelledError:
                if not stop.was_cut:
                    raise  # not the cut's: the session itself is cancelled
            finally:
                if stop.left():
                    # Whatever the handler made of the cut's cancellation, the session
                    # goes on: to roll the job back and commit the rest.
                    if session.cancelling():
                        session.uncancel()
                    raise CutShortError(_CUT_REASON)
            outcome = _completion(job, result)
            await conn.execute(*locked_write(app.schema, outcome))
    except (CutShortError, _NotStartedError) as stopped:
        batch.stopped(stopped)
        if isinstance(stopped, CutShortError):
            await conn.execute(*_shutdown_note(app, job))
            log.warning("job %s (%s): %s", job.id, job.task, stopped)
        return None
    except Exception as failure:
        batch.handler_left()
        if isinstance(failure, JobTimeoutError):
            failure = failure.with_traceback(None)  # its frames are skiplock's
        if conn.broken:
            raise failure from None
        return await _write_failure_async(batch, conn, failure)
    batch.handler_left()
    return outcome


async def _write_failure_async(
    batch: _Batch, conn: psycopg.AsyncConnection[Any], exc: BaseException
) -> Outcome:
    """Write the failed attempt in a savepoint of its own; if PostgreSQL refuses it, a
    plain failure naming the reason instead."""
    outcome = batch.failure(exc)
    try:
        async with conn.transaction():
            await conn.execute(*locked_write(batch.app.schema, outcome))
    except psycopg.Error as refused:
        if conn.broken:
            raise
        outcome = batch.refused(refused)
        await conn.execute(*locked_write(batch.app.schema, outcome))
    return outcome


async def _charge_async(
    run: TransactionalRun, conn: psycopg.AsyncConnection[Any], job: ClaimedJob, exc: BaseException
) -> None:
    app = run.app
    step = _charge_statement(app, job, _lost_reason(exc), run.clock(), run.rng)
    try:
        if not conn.broken and not conn.closed:
            await conn.execute(*step)  # the session lives; its transaction rolled back
            return
        async with await psycopg.AsyncConnection.connect(
            app.database_url, autocommit=True, connect_timeout=10
        ) as other:
            await other.execute(*step)
    except Exception:
        log.exception("could not count the lost attempt of job %s", job.id)


def _charge_sync(
    run: TransactionalRun, conn: psycopg.Connection[Any] | None, job: ClaimedJob, exc: BaseException
) -> bool:
    """Count a lost attempt (see JOB_CHARGE_LOST_ATTEMPT); True when it was counted now."""
    app = run.app
    step = _charge_statement(app, job, _lost_reason(exc), run.clock(), run.rng)
    try:
        if conn is not None and not conn.broken and not conn.closed:
            return conn.execute(*step).fetchone() is not None
        with psycopg.connect(app.database_url, autocommit=True, connect_timeout=10) as other:
            return other.execute(*step).fetchone() is not None
    except Exception:
        log.exception("could not count the lost attempt of job %s", job.id)
        return False


@contextmanager
def _watchdog(
    app: App,
    conn: psycopg.Connection[Any],
    job: ClaimedJob,
    timeout: float | None,
    clock: Clock,
    rng: random.Random,
) -> Iterator[threading.Event]:
    """While a sync handler with a timeout runs, a session of its own waits on the job's
    row lock. If the server ends the job's session (the handler stuck past its timeout:
    its thread cannot be stopped), the wait is granted at once, ahead of any claim, and
    the attempt is counted (decision 002). When the job ends normally the wait is
    cancelled. A handler that never returns thus still uses up its attempts. The body
    runs only once the wait is queued (or the watch could not start): a session ended
    before that would free the row to a claim, uncounted. Yields the event that ends the
    watch: a cut at the shutdown deadline sets it before its commit."""
    done = threading.Event()
    if timeout is None:
        yield done
        return
    session: list[psycopg.Connection[Any]] = []
    connected, gone = threading.Event(), threading.Event()
    reason = (
        f"the handler outlived its timeout of {timeout}s and the server ended its "
        "session, rolling back its transaction; the attempt is counted"
    )

    def watch() -> None:
        try:
            with psycopg.connect(app.database_url, connect_timeout=10) as other:
                session.append(other)
                connected.set()
                if done.is_set():
                    return
                await_end = render(complete.JOB_AWAIT_SESSION_END, app.schema)
                row = other.execute(await_end, {"id": job.id, "attempts": job.attempts}).fetchone()
                if row is None or done.is_set():
                    return  # the job ended normally (or committed before the wait began)
                charged = other.execute(*_charge_statement(app, job, reason, clock(), rng))
                if charged.fetchone() is not None:
                    other.commit()
                    log.warning("job %s: %s", job.id, reason)
        except psycopg.errors.QueryCanceled:
            pass  # the job ended normally
        except Exception:
            if not done.is_set():
                log.exception("job %s: the watch on its session failed", job.id)
        finally:
            gone.set()
            connected.set()

    threading.Thread(target=watch, name=f"skiplock-watch-{job.id}", daemon=True).start()
    try:
        _await_watch(app, conn, session, connected, gone)
        yield done
    finally:
        done.set()
        if session:
            with suppress(Exception):
                session[0].cancel_safe(timeout=2.0)


def _await_watch(
    app: App,
    conn: psycopg.Connection[Any],
    session: list[psycopg.Connection[Any]],
    connected: threading.Event,
    gone: threading.Event,
    patience: float = 10.0,
) -> None:
    """Return once the watch's session waits on the job's row lock, or the watch ended
    (it failed), or ``patience`` seconds have passed (the handler then runs unwatched)."""
    deadline = time.monotonic() + patience
    if not connected.wait(patience) or not session:
        return
    query = render(complete.WATCH_IS_WAITING, app.schema)
    params = {"watcher": session[0].info.backend_pid}
    pause = 0.001
    while time.monotonic() < deadline and not gone.is_set():
        row = conn.execute(query, params).fetchone()
        if row is not None and row[0]:
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    if gone.is_set():
        return  # the watch failed, and said so
    log.warning("the watch on a sync job's session was not waiting after %ss", patience)


def _cut_sync(
    app: App, conn: psycopg.Connection[Any], job: ClaimedJob, watched: threading.Event
) -> None:
    """Cut a sync batch's running job short for its thread, which is in the handler and
    cannot be stopped (BatchStop.cut calls this from another thread): its statement in
    progress cancelled, the batch committed without the job (BATCH_COMMIT_CUT), and the
    session closed, so that nothing the handler still sends can commit."""
    watched.set()  # the watchdog, granted the row at the commit, must not charge it
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
        with suppress(psycopg.Error):
            conn.cancel_safe(timeout=2.0)  # the handler's statement in progress ends
    query = render(complete.BATCH_COMMIT_CUT, app.schema)
    params = {"id": job.id, "channel": done_channel(app.schema)}
    try:
        for _ in range(3):
            try:
                psycopg.ClientCursor(conn).execute(query, params)
                return
            except psycopg.errors.QueryCanceled:
                # The cancel meant for the handler's statement came late, and hit this one.
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR:
                    raise
        raise psycopg.OperationalError("the cut's commit was cancelled three times")
    except Exception:
        log.exception("could not commit the batch of a cut-short sync job; it rolls back")
    finally:
        with conn.lock:  # not while the handler's thread is inside a statement
            conn.close()


def run_transactional_sync(conn: psycopg.Connection[Any], run: TransactionalRun) -> int:
    """``run_transactional_async`` for sync handlers, run in a worker thread. A task's timeout
    is enforced by the server (SESSION_LIMIT), for that job only. A cut cannot stop the
    thread: the batch is committed for it (_cut_sync), and its connection closed."""
    app, stop = run.app, run.stop
    batch: _Batch | None = None
    try:
        with conn.transaction():
            # The handler's own writes commit with the job: they must be durable.
            conn.execute(render(complete.DURABLE_COMMIT_ON, app.schema))
            rows = conn.execute(
                render(claim.JOB_LOCK_BATCH, app.schema),
                _lock_params(run.queue, run.tasks, run.limit, run.governed),
            ).fetchall()
            jobs = [claimed_from_row(r) for r in rows]
            run.on_claimed(len(jobs))
            batch = _Batch(app, jobs, rng=run.rng, clock=run.clock, on_finished=run.on_finished)
            set_step_store(
                LockedStore(conn, app.schema), tracing=app.tracing
            )  # steps commit with the batch
            limits = _SessionLimits(app, conn)
            for job in stop.jobs_to_start(jobs):
                batch.begin(job)
                timeout = app.tasks[job.task].options.timeout
                outcome = _attempt_sync(batch, conn, job, stop, limits, timeout)
                if outcome is None:
                    break
                limits.reset(timeout)
                batch.ended(outcome)
            if jobs:
                conn.execute(*results_notice(app.schema))
    except CutShortError as cut:
        assert batch is not None
        running = batch.aborted(cut)
        set_current_job(None)
        if running is not None:
            log.warning("job %s (%s): %s", running.id, running.task, cut)
        return batch.finished
    except Exception as exc:
        lost = None if batch is None else batch.aborted(exc)
        if lost is not None:
            _charge_sync(run, conn, lost, exc)
        raise
    assert batch is not None
    return batch.finished


class _SessionLimits:
    """A sync session's statement and idle limits, set to a task's timeout for its job and
    back to the session's own after it (read once, when first needed)."""

    def __init__(self, app: App, conn: psycopg.Connection[Any]) -> None:
        self._conn, self._schema = conn, app.schema
        self._own: tuple[Any, ...] | None = None

    def set(self, timeout: float | None) -> None:
        if timeout is None:
            return
        if self._own is None:
            self._own = self._conn.execute(
                render(complete.SESSION_LIMITS_READ, self._schema)
            ).fetchone()
        self._conn.execute(render(complete.SESSION_LIMIT, self._schema), _limit_params(timeout))

    def reset(self, timeout: float | None) -> None:
        """Back to the session's own limits: the next job must not inherit these."""
        if timeout is None or self._own is None:
            return
        idle, statement = self._own
        self._conn.execute(
            render(complete.SESSION_LIMIT, self._schema), {"idle": idle, "statement": statement}
        )


def _attempt_sync(
    batch: _Batch,
    conn: psycopg.Connection[Any],
    job: ClaimedJob,
    stop: BatchStop,
    limits: _SessionLimits,
    timeout: float | None,
) -> Outcome | None:
    """Run ``job``'s handler in its savepoint, watched and limited when it has a timeout,
    and write its outcome; None when a stop came before it started. A cut raises
    CutShortError: the batch is committed and closed for us (_cut_sync)."""
    app = batch.app
    try:
        if job.args_error is not None:
            raise ArgumentsError(job.args_error)
        with _watchdog(app, conn, job, timeout, batch.clock, batch.rng) as watched:
            # Only now: the server would end a session idle past the limit while the
            # watch was still starting.
            limits.set(timeout)
            with conn.transaction(complete.JOB_SAVEPOINT):
                commit_for_us = partial(_cut_sync, app, conn, job, watched)
                if not stop.entered(job, commit_for_us, batch.left):
                    raise _NotStartedError
                try:
                    result = app.tasks[job.task].fn(conn, **job.args)
                finally:
                    if stop.left():
                        # Committed and closed for us (_cut_sync): touch nothing.
                        raise CutShortError(_CUT_REASON)
                outcome = _completion(job, result)
                conn.execute(*locked_write(app.schema, outcome))
    except CutShortError:
        raise  # the batch is committed and closed for us
    except _NotStartedError as unstarted:
        batch.stopped(unstarted)
        return None
    except Exception as failure:
        batch.handler_left()
        if conn.broken:
            raise
        return _write_failure_sync(batch, conn, failure)
    batch.handler_left()
    return outcome


def _write_failure_sync(
    batch: _Batch, conn: psycopg.Connection[Any], exc: BaseException
) -> Outcome:
    """Sync twin of _write_failure_async."""
    outcome = batch.failure(exc)
    try:
        with conn.transaction():
            conn.execute(*locked_write(batch.app.schema, outcome))
    except psycopg.Error as refused:
        if conn.broken:
            raise
        outcome = batch.refused(refused)
        conn.execute(*locked_write(batch.app.schema, outcome))
    return outcome
