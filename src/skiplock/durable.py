"""Durable steps: a handler's work in named steps, each run once per job, whatever
happens to the attempts around it.

    @app.task(max_attempts=5)
    def checkout(order_id: int) -> None:
        charge = skiplock.step("charge", charge_card, order_id)
        skiplock.step("receipt", send_receipt, order_id, charge["id"])
        skiplock.step("webhook", notify_partner, order_id)

A step's result is recorded (migration 0028) when it returns; a later attempt of the same
job gets the recorded result without running it. In lease mode the record is fenced by
the attempt, as outcomes are: an attempt that lost its lease records nothing and stops
(LeaseLostError). A transactional job's records are written in its transaction:
they commit with the job, and roll back with a failed attempt, so its steps run again
then (their database writes rolled back with them).

A step returns its result as JSON gives it back (a tuple comes back a list), the first
time as on every later attempt, so a handler sees the same value either way.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from skiplock.config import results_notice
from skiplock.context import current_job_or_none
from skiplock.errors import (
    AttemptSuspended,
    ConfigurationError,
    ResultNotStorableError,
    SkiplockError,
    WaitTimeout,
)
from skiplock.sql import complete as complete_sql
from skiplock.sql import render
from skiplock.sql import signals as signal_sql
from skiplock.sql import steps as statements
from skiplock.storable import encode_result, problem_in, storable_json_text
from skiplock.tracing import Tracing
from skiplock.types import ClaimedJob

T = TypeVar("T")

log = logging.getLogger("skiplock.worker")

MAX_STEP_NAME = 200
MAX_STEP_RESULT_BYTES = 1024 * 1024


class LeaseLostError(SkiplockError):
    """The attempt no longer holds its job (its lease ran out and the job was given to
    another attempt): a step it ran is not recorded, its completion is refused, and the
    attempt must stop."""


def _on_loop(
    loop: asyncio.AbstractEventLoop | None, coro: Coroutine[Any, Any, T], what: str = "step()"
) -> T:
    """Run ``coro`` on ``loop`` (the worker's, or a test's) from a handler's thread, and
    wait for it. On the loop's own thread that would never return: refused."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if loop is not None:
            return asyncio.run_coroutine_threadsafe(coro, loop).result()
    coro.close()
    raise ConfigurationError(
        f"skiplock.{what} called on the event loop: in an async handler, "
        "use its _async form with await"
    )


class StepStore:
    """Where a job's steps are read from and recorded: one per worker (lease mode), per
    transactional session, or per test drain."""

    async def load(self, job: ClaimedJob) -> dict[str, str | None]:
        raise NotImplementedError

    async def record(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        raise NotImplementedError

    def load_sync(self, job: ClaimedJob) -> dict[str, str | None]:
        raise NotImplementedError

    def record_sync(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        raise NotImplementedError

    # Waits and sleeps end the attempt where the job is held: a store that cannot (a
    # transactional attempt, a test without a database) refuses them.
    async def suspend(self, job: ClaimedJob, suspension: Suspension) -> Suspension:
        return self.suspend_sync(job, suspension)

    def suspend_sync(self, job: ClaimedJob, suspension: Suspension) -> Suspension:
        raise ConfigurationError(suspension.refusal("this store"))


class Suspension:
    """A wait for ``key`` (None: a sleep) of ``seconds`` (None: no limit), recorded as the
    step ``step``: the statements that write it, and what they answered (``outcome``:
    "waiting" or "sleeping" when the job now does, "signal" with ``payload`` when a kept
    signal was taken at once, "lost" when the attempt no longer held its job)."""

    def __init__(self, key: str | None, step: str, seconds: float | None) -> None:
        self.key = key
        self.step = step
        self.seconds = seconds
        self.outcome = ""
        self.payload: str | None = None

    def refusal(self, where: str) -> str:
        what = "wait_for" if self.key is not None else "sleep"
        return (
            f"skiplock.{what}() ends the attempt and resumes the job later, which needs a "
            f"lease-mode job run by a worker (or by skiplock.testing.drain); {where} it "
            "cannot: a transactional job would hold its transaction open"
        )

    def statements(
        self, schema: str, job: ClaimedJob, worker_id: Any
    ) -> list[tuple[str, dict[str, Any]]]:
        """The statements to run in one transaction, in order; the last one's row is
        the answer (``read``)."""
        params = {
            "id": job.id,
            "attempt": job.attempts,
            "worker_id": worker_id,
            "step": self.step,
            "seconds": self.seconds,
        }
        if self.key is None:
            return [(render(signal_sql.JOB_SLEEP_IF_HELD, schema), params)]
        lock = {"lock": f"{schema}.signal\t{self.key}"}
        return [
            (render(signal_sql.SIGNAL_KEY_LOCK, schema), lock),
            (render(signal_sql.JOB_WAIT_IF_HELD, schema), {**params, "key": self.key}),
        ]

    async def written_async(
        self, conn: psycopg.AsyncConnection[Any], schema: str, job: ClaimedJob, worker_id: Any
    ) -> Suspension:
        """Written on ``conn``, in its current transaction; answered."""
        row = None
        for statement, params in self.statements(schema, job, worker_id):
            row = await (await conn.execute(statement, params)).fetchone()
        return self.read(row)

    def written(
        self, conn: psycopg.Connection[Any], schema: str, job: ClaimedJob, worker_id: Any
    ) -> Suspension:
        row = None
        for statement, params in self.statements(schema, job, worker_id):
            row = conn.execute(statement, params).fetchone()
        return self.read(row)

    def read(self, row: Any) -> Suspension:
        if self.key is None:
            self.outcome = "sleeping" if row is not None else "lost"
        elif row is None or not row[0]:
            self.outcome = "lost"
        elif row[2]:
            self.outcome = "waiting"
        else:
            self.outcome, self.payload = "signal", row[1]
        return self


_Answer = asyncio.Future[T] | Future[T]


class LeasedStore(StepStore):
    """Lease-mode attempts' steps, read and recorded on the worker's pool, fenced by each
    attempt. The reads and records that come in while one batch is written wait and go
    together in the next (``run``, a service of the worker): one statement for many jobs'
    steps, and one connection, however many handlers take steps at once. Sync handlers
    run in threads: their requests go to the worker's event loop, and the thread waits."""

    def __init__(self, pool: AsyncConnectionPool[Any], schema: str, worker_id: Any) -> None:
        self._pool = pool
        self._schema = schema
        self.worker_id = worker_id
        self.results_notice = results_notice(schema)
        self._loop = asyncio.get_running_loop()
        # Each request's future: an asyncio one (async handlers) or a thread-safe one.
        self._loads: list[tuple[int, _Answer[dict[str, str | None]]]] = []
        self._records: list[tuple[ClaimedJob, str, str | None, _Answer[bool]]] = []
        self._ready = asyncio.Event()

    def sql(self, template: str) -> str:
        return render(template, self._schema)

    async def load(self, job: ClaimedJob) -> dict[str, str | None]:
        future: asyncio.Future[dict[str, str | None]] = self._loop.create_future()
        self._loads.append((job.id, future))
        self._ready.set()
        return await future

    async def record(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        future: asyncio.Future[bool] = self._loop.create_future()
        self._records.append((job, name, result, future))
        self._ready.set()
        return await future

    def load_sync(self, job: ClaimedJob) -> dict[str, str | None]:
        future: Future[dict[str, str | None]] = Future()
        self._from_thread(self._add_load, (job.id, future))
        return future.result()

    def record_sync(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        future: Future[bool] = Future()
        self._from_thread(self._add_record, (job, name, result, future))
        return future.result()

    async def suspend(self, job: ClaimedJob, suspension: Suspension) -> Suspension:
        """A wait or a sleep, in a transaction of its own (not batched: a wait may queue
        for its key's lock behind a sender's open transaction), committed durably."""
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(self.sql(complete_sql.DURABLE_COMMIT_ON))
            return await suspension.written_async(conn, self._schema, job, self.worker_id)

    def suspend_sync(self, job: ClaimedJob, suspension: Suspension) -> Suspension:
        return _on_loop(self._loop, self.suspend(job, suspension), "sleep() or wait_for()")

    def _from_thread(self, add: Callable[[Any], None], request: Any) -> None:
        """Hand a sync handler's request to the event loop's next batch (one callback, no
        task per step); the batch answers it through its thread-safe future."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._loop.call_soon_threadsafe(add, request)
            return
        raise ConfigurationError(
            "skiplock.step() called on the event loop: in an async handler, "
            "use `await skiplock.step_async(...)`"
        )

    # On the loop: to the list of the batch still to come (run_once takes the lists whole,
    # so a request must be added to whichever list is current when it arrives).
    def _add_load(self, request: tuple[int, _Answer[dict[str, str | None]]]) -> None:
        self._loads.append(request)
        self._ready.set()

    def _add_record(self, request: tuple[ClaimedJob, str, str | None, _Answer[bool]]) -> None:
        self._records.append(request)
        self._ready.set()

    async def run(self) -> None:
        """Write what steps ask for, a batch at a time, until cancelled."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self.run_once()

    async def run_once(self) -> None:
        """One batch: the reads, then the records, asked for since the last. A batch the
        database does not take fails the steps waiting for it (their attempts fail, and
        are retried as any failure): nothing is recorded that was not written."""
        loads, self._loads = self._loads, []
        records, self._records = self._records, []
        if not loads and not records:
            return
        try:
            async with self._pool.connection() as conn:
                if loads:
                    await self._answer_loads(conn, loads)
                if records:
                    await self._write_records(conn, records)
        except Exception as exc:
            log.warning("recording durable steps failed (%s): their attempts fail", exc)
            waiting: list[_Answer[Any]] = [f for _, f in loads]
            waiting += [r[3] for r in records]
            for future in waiting:
                if not future.done():
                    future.set_exception(exc)

    async def _answer_loads(
        self,
        conn: psycopg.AsyncConnection[Any],
        loads: list[tuple[int, _Answer[dict[str, str | None]]]],
    ) -> None:
        cur = await conn.execute(self.sql(statements.STEPS_OF_JOBS), {"ids": [i for i, _ in loads]})
        found: dict[int, dict[str, str | None]] = {}
        for job_id, name, result in await cur.fetchall():
            found.setdefault(int(job_id), {})[str(name)] = result
        for job_id, future in loads:
            if not future.done():
                future.set_result(dict(found.get(job_id, {})))

    async def _write_records(
        self,
        conn: psycopg.AsyncConnection[Any],
        records: list[tuple[ClaimedJob, str, str | None, _Answer[bool]]],
    ) -> None:
        params = {
            "ids": [job.id for job, _, _, _ in records],
            "attempts": [job.attempts for job, _, _, _ in records],
            "names": [name for _, name, _, _ in records],
            "results": [result for _, _, result, _ in records],
            "worker_id": self.worker_id,
        }
        cur = await conn.execute(self.sql(statements.STEPS_RECORD_IF_HELD), params)
        written = {(int(job_id), str(name)) for job_id, name in await cur.fetchall()}
        for job, name, _, future in records:
            if not future.done():
                future.set_result((job.id, name) in written)


class LockedStore(StepStore):
    """A transactional attempt's steps (or a test's drain), written on the connection
    that holds the job: they commit or roll back with its transaction."""

    def __init__(
        self,
        conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
        schema: str,
        *,
        worker_id: Any = None,
    ) -> None:
        self._conn = conn
        # A test's drain holds its lease-mode jobs as a worker does: they may wait.
        self._worker_id = worker_id
        # An async connection is used from a sync handler's thread through its loop.
        self._loop = (
            asyncio.get_running_loop() if isinstance(conn, psycopg.AsyncConnection) else None
        )
        self._schema = schema

    @staticmethod
    def _params(job: ClaimedJob, name: str, result: str | None) -> dict[str, Any]:
        return {"id": job.id, "name": name, "attempt": job.attempts, "result": result}

    async def load(self, job: ClaimedJob) -> dict[str, str | None]:
        conn = self._conn
        if not isinstance(conn, psycopg.AsyncConnection):
            return self.load_sync(job)
        cur = await conn.execute(render(statements.STEPS_OF_JOBS, self._schema), {"ids": [job.id]})
        return {str(name): result for _, name, result in await cur.fetchall()}

    async def record(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        conn = self._conn
        if not isinstance(conn, psycopg.AsyncConnection):
            return self.record_sync(job, name, result)
        cur = await conn.execute(
            render(statements.STEP_RECORD_LOCKED, self._schema), self._params(job, name, result)
        )
        return await cur.fetchone() is not None

    def load_sync(self, job: ClaimedJob) -> dict[str, str | None]:
        conn = self._conn
        if isinstance(conn, psycopg.AsyncConnection):
            return _on_loop(self._loop, self.load(job))
        cur = conn.execute(render(statements.STEPS_OF_JOBS, self._schema), {"ids": [job.id]})
        return {str(name): result for _, name, result in cur.fetchall()}

    def record_sync(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        conn = self._conn
        if isinstance(conn, psycopg.AsyncConnection):
            return _on_loop(self._loop, self.record(job, name, result))
        cur = conn.execute(
            render(statements.STEP_RECORD_LOCKED, self._schema), self._params(job, name, result)
        )
        return cur.fetchone() is not None

    async def suspend(self, job: ClaimedJob, suspension: Suspension) -> Suspension:
        conn = self._conn
        if not isinstance(conn, psycopg.AsyncConnection):
            return self.suspend_sync(job, suspension)
        if self._worker_id is None:
            raise ConfigurationError(suspension.refusal("a transactional attempt"))
        return await suspension.written_async(conn, self._schema, job, self._worker_id)

    def suspend_sync(self, job: ClaimedJob, suspension: Suspension) -> Suspension:
        conn = self._conn
        if isinstance(conn, psycopg.AsyncConnection):
            return _on_loop(self._loop, self.suspend(job, suspension), "sleep() or wait_for()")
        if self._worker_id is None:
            raise ConfigurationError(suspension.refusal("a transactional attempt"))
        return suspension.written(conn, self._schema, job, self._worker_id)


class MemoryStore(StepStore):
    """Steps kept in memory, for ``skiplock.testing.perform_job`` without a database:
    each runs once per call."""

    def suspend_sync(self, job: ClaimedJob, suspension: Suspension) -> Suspension:
        raise ConfigurationError(
            suspension.refusal("skiplock.testing.perform_job without a connection")
        )

    def __init__(self) -> None:
        self._recorded: dict[str, str | None] = {}

    async def load(self, job: ClaimedJob) -> dict[str, str | None]:
        return self.load_sync(job)

    async def record(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        return self.record_sync(job, name, result)

    def load_sync(self, job: ClaimedJob) -> dict[str, str | None]:
        return dict(self._recorded)

    def record_sync(self, job: ClaimedJob, name: str, result: str | None) -> bool:
        self._recorded.setdefault(name, result)
        return True


class _Attempt:
    """One attempt's steps: those recorded before (read at its first step) and the
    names it has used. Made at the attempt's first step: a job without steps costs one
    context variable."""

    def __init__(self, store: StepStore, job: ClaimedJob) -> None:
        self.store = store
        self.job = job
        self.recorded: dict[str, str | None] | None = None
        self.used: set[str] = set()
        self.completed = False
        # Waits and sleeps done, by their name's base: the next is numbered after them.
        self.counts: dict[str, int] = {}

    def numbered(self, base: str) -> str:
        """The name of the next wait or sleep of ``base`` ("wait:KEY", "sleep"): the same
        on every attempt of a handler that waits in the same order."""
        done = self.counts.get(base, 0)
        return base if done == 0 else f"{base}#{done + 1}"

    def counted(self, base: str, name: str, text: str | None) -> Any:
        self.counts[base] = self.counts.get(base, 0) + 1
        return self.done(name, text)

    def claim_name(self, given: object) -> str:
        name = checked_name(given, "step name", MAX_STEP_NAME)
        if name in self.used:
            raise ConfigurationError(
                f"step {name!r} ran already in this attempt: step names are unique within a "
                f"job (put a loop's index in the name: f'{name} {{i}}')"
            )
        return name

    def done(self, name: str, text: str | None) -> Any:
        """The step ``name`` returned (or was answered from its record): used from now on
        in this attempt. A step that raised is not, and may be tried again in it."""
        self.used.add(name)
        return _decoded(text)


_store: ContextVar[StepStore | None] = ContextVar("skiplock_step_store", default=None)
_attempt: ContextVar[_Attempt | None] = ContextVar("skiplock_steps", default=None)
_completing: ContextVar[Callable[[], None] | None] = ContextVar("skiplock_completing", default=None)
_tracing: ContextVar[Tracing | None] = ContextVar("skiplock_step_tracing", default=None)


def set_step_store(
    store: StepStore | None,
    completing: Callable[[], None] | None = None,
    tracing: Tracing | None = None,
) -> None:
    """Where the steps of the job this context runs are kept (None outside a job), whom
    to tell when its handler ends the attempt itself (complete, a wait, a sleep: lease
    mode), and the tracer that gives each step a span."""
    _store.set(store)
    _completing.set(completing)
    _tracing.set(tracing)


def _span(attempt: _Attempt, name: str, *, replayed: bool) -> AbstractContextManager[object]:
    tracing = _tracing.get()
    if tracing is None:
        return nullcontext()
    return tracing.step(attempt.job, name, replayed=replayed)


def _current(what: str) -> _Attempt:
    store, job = _store.get(), current_job_or_none()
    if store is None or job is None:
        raise RuntimeError(f"skiplock.{what}() called outside a running job")
    attempt = _attempt.get()
    # A transactional session's jobs share one context, one after another.
    if attempt is None or attempt.job is not job:
        attempt = _Attempt(store, job)
        _attempt.set(attempt)
    return attempt


def _encode(name: str, value: object) -> str | None:
    """The step's result as JSON text, or refused saying why: a value JSON has no form
    for would come back different on a later attempt."""
    if value is None:
        return None
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ResultNotStorableError(
            f"step {name!r}: its result must be JSON (dict, list, str, int, float, bool or "
            f"None): {exc}"
        ) from None
    # Storable first: a lone surrogate has no UTF-8 bytes to count.
    if not storable_json_text(text):
        raise ResultNotStorableError(f"step {name!r}: result not storable: {problem_in(value)}")
    if len(text.encode()) > MAX_STEP_RESULT_BYTES:
        raise ResultNotStorableError(
            f"step {name!r}: its result is {len(text.encode()):,} bytes of JSON; "
            f"keep it under {MAX_STEP_RESULT_BYTES // 1024} KiB"
        )
    return text


def _decoded(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _refused(name: str, attempt: _Attempt) -> LeaseLostError:
    job = attempt.job
    return LeaseLostError(
        f"step {name!r} of job {job.id}: attempt {job.attempts} no longer holds the job "
        "(its lease ran out); the step ran but is not recorded"
    )


def step(name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as the step ``name`` of the running job, once: if an
    earlier attempt recorded it, return its recorded result without calling ``fn``.
    The result must be JSON; it is returned as JSON gives it back."""
    attempt = _current("step")
    name = attempt.claim_name(name)
    if attempt.recorded is None:
        attempt.recorded = attempt.store.load_sync(attempt.job)
    if name in attempt.recorded:
        with _span(attempt, name, replayed=True):
            return attempt.done(name, attempt.recorded[name])
    with _span(attempt, name, replayed=False):
        text = _encode(name, fn(*args, **kwargs))
        if not attempt.store.record_sync(attempt.job, name, text):
            raise _refused(name, attempt)
    attempt.recorded[name] = text
    return attempt.done(name, text)


async def step_async(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``step`` for async handlers: ``fn`` may be a coroutine function or a plain one."""
    attempt = _current("step_async")
    name = attempt.claim_name(name)
    if attempt.recorded is None:
        attempt.recorded = await attempt.store.load(attempt.job)
    if name in attempt.recorded:
        with _span(attempt, name, replayed=True):
            return attempt.done(name, attempt.recorded[name])
    with _span(attempt, name, replayed=False):
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = await value
        text = _encode(name, value)
        if not await attempt.store.record(attempt.job, name, text):
            raise _refused(name, attempt)
    attempt.recorded[name] = text
    return attempt.done(name, text)


# -- completion in the handler's own transaction ---------------------------------------


def _completion(what: str, result: object) -> tuple[_Attempt, LeasedStore, dict[str, Any]]:
    attempt = _current(what)
    store = attempt.store
    if not isinstance(store, LeasedStore):
        raise ConfigurationError(
            f"skiplock.{what}() is for lease-mode jobs run by a worker: a transactional job "
            "completes with its own transaction already"
        )
    if attempt.completed:
        raise ConfigurationError(f"skiplock.{what}() was called already for this attempt")
    job = attempt.job
    entry = {"attempt": job.attempts, "result": encode_result(result)}
    params = {
        "ids": [job.id],
        "batch": json.dumps({str(job.id): entry}),
        "worker_id": store.worker_id,
    }
    return attempt, store, params


def _completed(attempt: _Attempt, row: object) -> None:
    if row is None:
        job = attempt.job
        raise LeaseLostError(
            f"job {job.id}: attempt {job.attempts} no longer holds the job (its lease ran "
            "out), or this connection is not to its database; not completed"
        )
    attempt.completed = True
    completing = _completing.get()
    if completing is not None:
        completing()


def complete(conn: psycopg.Connection[Any], /, result: object = None) -> None:
    """Complete the running lease-mode job in ``conn``'s current transaction, fenced by
    its attempt: the job moves to history with ``result`` when that transaction commits,
    together with the caller's own writes in it; if it rolls back, so does the completion.
    Raises LeaseLostError (and the caller's transaction should roll back) when the
    attempt no longer holds its job. The transaction must commit before the handler
    returns; the worker writes nothing more for an attempt completed this way."""
    attempt, store, params = _completion("complete", result)
    row = conn.execute(store.sql(complete_sql.JOB_COMPLETE_MANY_IF_LEASED), params).fetchone()
    if row is not None:
        conn.execute(*store.results_notice)
    _completed(attempt, row)


async def complete_async(conn: psycopg.AsyncConnection[Any], /, result: object = None) -> None:
    """``complete`` on an async connection."""
    attempt, store, params = _completion("complete_async", result)
    cur = await conn.execute(store.sql(complete_sql.JOB_COMPLETE_MANY_IF_LEASED), params)
    row = await cur.fetchone()
    if row is not None:
        await conn.execute(*store.results_notice)
    _completed(attempt, row)


# -- durable waits and sleeps -----------------------------------------------------------

MAX_SIGNAL_KEY = 180
# The furthest a wait or a sleep may reach (as Snooze's limit: a mistake, past that).
MAX_SUSPEND_SECONDS = 10 * 366 * 86400.0


def check_signal_key(key: object) -> str:
    """``key`` if a signal can carry it, else a ConfigurationError saying why."""
    return checked_name(key, "signal key", MAX_SIGNAL_KEY)


def checked_name(value: object, what: str, longest: int) -> str:
    """``value`` if it is a string PostgreSQL stores, 1 to ``longest`` characters long;
    else a ConfigurationError naming ``what`` and the problem."""
    if not isinstance(value, str) or not value or len(value) > longest:
        raise ConfigurationError(
            f"a {what} is a non-empty string of at most {longest} characters, got {value!r}"
        )
    if not storable_json_text(json.dumps(value)):
        raise ConfigurationError(f"{what} {value!r} cannot be stored: {problem_in(value)}")
    return value


def _seconds(what: str, value: object, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigurationError(f"{what} is a number of seconds or a timedelta, got {value!r}")
    if not 0 <= seconds <= MAX_SUSPEND_SECONDS:  # nan fails both
        raise ConfigurationError(f"{what} must be between 0 and ten years, got {seconds!r} seconds")
    return seconds


def _waited(attempt: _Attempt, base: str, name: str, key: str, text: str | None) -> Any:
    """The recorded answer of the wait ``name``: the signal's payload, or WaitTimeout."""
    answer = _decoded(text)
    attempt.counted(base, name, text)
    if isinstance(answer, dict) and "signal" in answer:
        return answer["signal"]
    if isinstance(answer, dict) and answer.get("timeout") is True:
        raise WaitTimeout(f"job {attempt.job.id}: no signal {key!r} came before its wait's timeout")
    raise ConfigurationError(
        f"step {name!r} of job {attempt.job.id} is not a wait's record: name steps so "
        "that they do not start with 'wait:'"
    )


def _suspended(attempt: _Attempt, suspension: Suspension) -> NoReturn:
    """Raise what ends the handler once its job waits or sleeps (or lost its lease)."""
    job = attempt.job
    if suspension.outcome == "lost":
        raise LeaseLostError(
            f"job {job.id}: attempt {job.attempts} no longer holds the job (its lease ran "
            "out); it neither waits nor sleeps"
        )
    completing = _completing.get()
    if completing is not None:
        completing()  # the row is no longer the worker's: nothing more to write or extend
    raise AttemptSuspended(suspension.outcome)


def _took(attempt: _Attempt, base: str, suspension: Suspension) -> Any:
    """A kept signal answered the wait at once: recorded, the attempt goes on."""
    text = json.dumps({"signal": _decoded(suspension.payload)})
    assert attempt.recorded is not None
    attempt.recorded[suspension.step] = text
    return _waited(attempt, base, suspension.step, suspension.key or "", text)


def _wait_begun(who: str, key: str, timeout: object) -> tuple[_Attempt, Suspension, str]:
    """The attempt, the wait about to be recorded (its key, step name and time limit) and
    its counting base, from ``who``'s arguments."""
    attempt = _current(who)
    key = check_signal_key(key)
    seconds = _seconds(f"{who}'s timeout", timeout, optional=True)
    base = f"wait:{key}"
    return attempt, Suspension(key, attempt.claim_name(attempt.numbered(base)), seconds), base


def _wait_answer(attempt: _Attempt, wait: Suspension, base: str) -> tuple[bool, Any]:
    """(True, the payload) when the wait was answered in an earlier attempt."""
    assert attempt.recorded is not None
    if wait.step in attempt.recorded:
        return True, _waited(attempt, base, wait.step, wait.key or "", attempt.recorded[wait.step])
    return False, None


def _suspension_answer(attempt: _Attempt, base: str, suspension: Suspension) -> Any:
    """A kept signal's payload, or the end of this attempt while the job waits."""
    if suspension.outcome == "signal":
        return _took(attempt, base, suspension)
    _suspended(attempt, suspension)


def wait_for(key: str, timeout: float | timedelta | None = None) -> Any:
    """Wait for the signal ``key`` and return its payload. A signal sent already (and kept)
    answers at once; otherwise the attempt ends here, freeing its slot, and the job
    resumes when the signal comes (``App.signal``, or ``signal()`` in SQL): the handler
    runs again from the top, its steps answered from their records, and this call
    returns the payload. After ``timeout`` with no signal it raises WaitTimeout."""
    attempt, wait, base = _wait_begun("wait_for", key, timeout)
    if attempt.recorded is None:
        attempt.recorded = attempt.store.load_sync(attempt.job)
    answered, payload = _wait_answer(attempt, wait, base)
    if answered:
        return payload
    return _suspension_answer(attempt, base, attempt.store.suspend_sync(attempt.job, wait))


async def wait_for_async(key: str, timeout: float | timedelta | None = None) -> Any:
    """``wait_for`` for async handlers."""
    attempt, wait, base = _wait_begun("wait_for_async", key, timeout)
    if attempt.recorded is None:
        attempt.recorded = await attempt.store.load(attempt.job)
    answered, payload = _wait_answer(attempt, wait, base)
    if answered:
        return payload
    return _suspension_answer(attempt, base, await attempt.store.suspend(attempt.job, wait))


def sleep(duration: float | timedelta) -> None:
    """Sleep ``duration`` (seconds or a timedelta) durably: the attempt ends here, freeing
    its slot and its connection, and the job resumes after ``duration`` (by the
    database's clock, as late as the promoter's poll): the handler runs again from the
    top, its steps answered from their records, and this call returns at once."""
    attempt = _current("sleep")
    seconds = _seconds("sleep's duration", duration, optional=False)
    name = attempt.claim_name(attempt.numbered("sleep"))
    if attempt.recorded is None:
        attempt.recorded = attempt.store.load_sync(attempt.job)
    if name in attempt.recorded:
        attempt.counted("sleep", name, attempt.recorded[name])
        return
    _suspended(attempt, attempt.store.suspend_sync(attempt.job, Suspension(None, name, seconds)))


async def sleep_async(duration: float | timedelta) -> None:
    """``sleep`` for async handlers."""
    attempt = _current("sleep_async")
    seconds = _seconds("sleep_async's duration", duration, optional=False)
    name = attempt.claim_name(attempt.numbered("sleep"))
    if attempt.recorded is None:
        attempt.recorded = await attempt.store.load(attempt.job)
    if name in attempt.recorded:
        attempt.counted("sleep", name, attempt.recorded[name])
        return
    suspension = await attempt.store.suspend(attempt.job, Suspension(None, name, seconds))
    _suspended(attempt, suspension)


def signal_payload_json(key: str, payload: object) -> str:
    """A signal's payload as JSON text, or refused saying why (as a step's result is)."""
    try:
        text = _encode(key, payload)
    except ResultNotStorableError as exc:
        message = str(exc).replace("step ", "signal ", 1).replace("result", "payload")
        raise ConfigurationError(message) from None
    return "null" if text is None else text
