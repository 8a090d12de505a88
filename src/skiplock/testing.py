"""Helpers for testing code that uses skiplock, on a real PostgreSQL (docs/testing.md).

There is no in-memory fake: its semantics would drift from the SQL. Jobs are read from
skiplock's own tables (``enqueued_jobs``, ``assert_enqueued``, ``refute_enqueued``) and
run as a worker runs them (``perform_job``, ``drain``): the executor's code calls the
handler and decides what the attempt came to, and the worker's statements claim the job
and write its outcome. The pytest fixtures are in ``skiplock.pytest_plugin``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from skiplock import client
from skiplock.app import App
from skiplock.completer import (
    REFUSED_BACKOFF,
    outcome_writes,
    refused_error,
    storable_outcome,
)
from skiplock.context import set_current_job
from skiplock.executor import (
    claimed_from_row,
    failure_outcome,
    run_leased,
    run_transactional_async,
    run_transactional_sync,
    utcnow,
)
from skiplock.outcomes import Completed, Outcome, failed
from skiplock.sql import admin, claim, complete, render
from skiplock.storable import encode_result
from skiplock.tasks import JobSpec, Task, TaskCall
from skiplock.types import ClaimedJob, Job, JobState

__all__ = [
    "JobOutcome",
    "assert_enqueued",
    "drain",
    "drain_async",
    "enqueued_jobs",
    "perform_job",
    "perform_job_async",
    "refute_enqueued",
]

T = TypeVar("T")
Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]

# Jobs that are waiting to run: what "enqueued" means here. Running and dead jobs are not
# (nor finished ones, which are in history).
WAITING = frozenset({JobState.BLOCKED, JobState.SCHEDULED, JobState.AVAILABLE, JobState.RETRYABLE})
# More live jobs than this in a test's schema is not a unit test any more.
LIST_LIMIT = 10_000
# Failure messages list at most this many of the jobs that were enqueued.
SHOWN_JOBS = 20
# drain() stops with an error after this many runs: a handler that snoozes without delay,
# or enqueues a job that enqueues a job..., would otherwise never let it finish.
MAX_RUNS = 1000
# A lease long enough for any test; drain writes each outcome right after its run.
LEASE_SECONDS = 3600
# The transaction's own now(): the time jobs enqueued in it were given.
SERVER_NOW = "SELECT now()"
# ... and the clock's, which goes on while the transaction lasts.
SERVER_CLOCKS = "SELECT now(), clock_timestamp()"

# The worker's statements for each group of lease-mode outcomes (as the completer's).
_OUTCOME_STATEMENTS = {
    "completed": complete.JOB_COMPLETE_MANY_IF_LEASED,
    "failed": complete.JOB_FAIL_MANY_IF_LEASED,
    "snoozed": complete.JOB_SNOOZE_MANY_IF_LEASED,
    "cancelled": complete.JOB_CANCEL_MANY_IF_LEASED,
}


@dataclass(frozen=True)
class JobOutcome:
    """What one run of a job came to.

    ``kind`` is ``completed``, ``retried``, ``dead``, ``snoozed`` or ``cancelled``;
    ``result`` is the handler's return value after its trip through JSON; ``error`` the
    record a worker stores for a failed attempt (``type``, ``message``, ``traceback``);
    ``delay`` the seconds until a retried or snoozed job is due again."""

    job_id: int
    task: str
    args: dict[str, Any]
    kind: str
    result: Any = None
    error: dict[str, Any] | None = None
    delay: float = 0.0
    progress: Any = None

    @property
    def completed(self) -> bool:
        return self.kind == "completed"

    def __str__(self) -> str:
        call = f"#{self.job_id} {self.task}({_show_args(self.args)})"
        if self.error is not None:
            return f"{call}: {self.kind}: {self.error.get('type')}: {self.error.get('message')}"
        if self.kind == "completed":
            return f"{call}: completed -> {self.result!r}"
        return f"{call}: {self.kind}"


# -- reading what was enqueued -------------------------------------------------------------


def _app_and_task(target: App | Task[Any] | TaskCall[Any]) -> tuple[App, str | None]:
    if isinstance(target, App):
        return target, None
    if isinstance(target, TaskCall):
        target = target.task
    if isinstance(target, Task):
        return target.app, target.name
    raise TypeError(f"expected a skiplock App or task, got {type(target).__name__}")


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from jsonb (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def _args_match(stored: dict[str, Any], expected: dict[str, Any] | None) -> bool:
    """Every expected argument is there with that value; others may be there too."""
    if expected is None:
        return True
    return all(key in stored and stored[key] == value for key, value in expected.items())


def enqueued_jobs(
    conn: Conn,
    target: App | Task[Any] | TaskCall[Any],
    /,
    *,
    args: dict[str, Any] | None = None,
    queue: str | None = None,
) -> list[Job]:
    """The jobs waiting to run (blocked, scheduled, available or retryable) that ``conn``
    sees: all of an App's, or a task's, oldest first. ``args`` keeps those that have
    these arguments (and maybe others); ``queue`` those in that queue."""
    app, task = _app_and_task(target)
    expected = None if args is None else _as_json(args)
    jobs = client.list_jobs(conn, app.schema, queue=queue, task=task, limit=LIST_LIMIT)
    return [job for job in jobs if job.state in WAITING and _args_match(job.args, expected)]


def _show_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in args.items())


def _due(job: Job) -> datetime:
    if job.state is JobState.RETRYABLE and job.retry_at is not None:
        return job.retry_at
    return job.run_at


def _show_job(job: Job, now: datetime) -> str:
    wait = (_due(job) - now).total_seconds()
    when = f", due in {wait:.0f}s" if wait >= 0.5 else ""
    return f"  #{job.id} {job.task}({_show_args(job.args)}) queue={job.queue!r} {job.state}{when}"


def _listing(jobs: Sequence[Job], now: datetime, heading: str) -> str:
    if not jobs:
        return f"{heading}: none."
    lines = [f"{heading} ({len(jobs)}):"]
    lines.extend(_show_job(job, now) for job in jobs[:SHOWN_JOBS])
    if len(jobs) > SHOWN_JOBS:
        lines.append(f"  ... and {len(jobs) - SHOWN_JOBS} more")
    return "\n".join(lines)


def _server_now(conn: Conn) -> datetime:
    row = conn.execute(SERVER_NOW).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


Seconds = float | timedelta


def _seconds(value: Seconds) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _window(within: Seconds | tuple[Seconds, Seconds]) -> tuple[float, float]:
    """(earliest, latest) seconds from now: a bound alone means from any time to it."""
    if isinstance(within, tuple):
        return _seconds(within[0]), _seconds(within[1])
    return float("-inf"), _seconds(within)


def _wanted(
    task: Task[Any] | TaskCall[Any],
    args: dict[str, Any] | None,
    queue: str | None,
    within: Seconds | tuple[Seconds, Seconds] | None,
) -> str:
    name = _app_and_task(task)[1]
    words = [f"job of {name}"]
    if args is not None:
        words.append(f"with arguments ({_show_args(args)})")
    if queue is not None:
        words.append(f"in queue {queue!r}")
    if within is not None:
        low, high = _window(within)
        words.append(
            f"due within {high:g}s" if low == float("-inf") else f"due in {low:g}s to {high:g}s"
        )
    return " ".join(words)


def assert_enqueued(
    conn: Conn,
    task: Task[Any] | TaskCall[Any],
    /,
    *,
    args: dict[str, Any] | None = None,
    queue: str | None = None,
    scheduled_within: Seconds | tuple[Seconds, Seconds] | None = None,
    count: int | None = None,
) -> Job:
    """Fail unless ``conn`` sees a waiting job of ``task`` with these ``args`` (and maybe
    others) in ``queue``, due at most ``scheduled_within`` seconds from the transaction's
    now (or a pair: in between), and exactly ``count`` such jobs when given. Returns the
    oldest match. The failure message lists the jobs that *were* enqueued."""
    if count is not None and count < 1:
        raise ValueError(
            f"count={count}: to check that no such job was enqueued, use refute_enqueued"
        )
    app = _app_and_task(task)[0]
    now = _server_now(conn)
    found = enqueued_jobs(conn, task, args=args, queue=queue)
    if scheduled_within is not None:
        low, high = _window(scheduled_within)
        found = [job for job in found if low <= (_due(job) - now).total_seconds() <= high]
    if found and (count is None or len(found) == count):
        return found[0]
    wanted = _wanted(task, args, queue, scheduled_within)
    got = "none was" if not found else f"{len(found)} were"
    expected = f"expected {count} x {wanted}" if count is not None else f"expected a {wanted}"
    raise AssertionError(
        f"{expected}; {got} enqueued.\n" + _listing(enqueued_jobs(conn, app), now, "Enqueued jobs")
    )


def refute_enqueued(
    conn: Conn,
    task: Task[Any] | TaskCall[Any],
    /,
    *,
    args: dict[str, Any] | None = None,
    queue: str | None = None,
) -> None:
    """Fail if ``conn`` sees a waiting job of ``task`` with these ``args`` in ``queue``,
    listing the jobs that match."""
    found = enqueued_jobs(conn, task, args=args, queue=queue)
    if found:
        raise AssertionError(
            f"expected no {_wanted(task, args, queue, None)}; found:\n"
            + _listing(found, _server_now(conn), "Matching jobs")
        )


# -- running jobs as a worker would ------------------------------------------------------


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end from sync code, even inside a running event loop (an async
    test calling the sync helpers): then on a loop of its own, in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="skiplock-testing") as runner:
        return runner.submit(asyncio.run, coro).result()


class _Progress:
    """Where ``set_progress`` writes during a test run: the latest value wins."""

    def __init__(self) -> None:
        self.json: str | None = None

    def __call__(self, encoded: str) -> None:
        self.json = encoded

    @property
    def value(self) -> Any:
        return None if self.json is None else json.loads(self.json)


def _outcome(job: ClaimedJob, outcome: Outcome, progress: Any = None) -> JobOutcome:
    return JobOutcome(
        job_id=job.id,
        task=job.task,
        args=job.args,
        kind=outcome.kind,
        result=None if outcome.result_json is None else json.loads(outcome.result_json),
        error=outcome.error,
        delay=outcome.delay,
        progress=progress,
    )


async def _run_leased(app: App, job: ClaimedJob, progress: _Progress) -> Outcome:
    """The worker's run of a lease-mode job: sync handlers in a thread, async ones on this
    loop, the task's timeout applied, a real ``current_job()``."""
    threads = ThreadPoolExecutor(1, thread_name_prefix="skiplock-testing")
    try:
        return await run_leased(app, job, threads, rng=random.Random(), progress=progress)
    finally:
        threads.shutdown(wait=False)  # a handler abandoned at its timeout keeps its thread


def _task_of(task: Task[Any] | TaskCall[Any]) -> Task[Any]:
    if isinstance(task, TaskCall):
        return task.task
    if isinstance(task, Task):
        return task
    raise TypeError(f"expected a skiplock task, got {type(task).__name__}")


def _performed_job(spec: JobSpec, attempts: int) -> ClaimedJob:
    """The job a worker would have claimed for ``spec``: its arguments decoded from the
    JSON text enqueue would have stored."""
    now = utcnow()
    row = (0, spec.queue, spec.task, spec.args_json, spec.priority, now, attempts)
    return claimed_from_row((*row, spec.max_attempts, now))


def _check_connection(task: Task[Any], conn: object, wanted: type[object]) -> None:
    kind = "psycopg.AsyncConnection" if wanted is psycopg.AsyncConnection else "psycopg.Connection"
    if not task.options.transactional:
        if conn is not None:
            raise TypeError(f"{task.name} is not transactional: its handler takes no connection")
        return
    if not isinstance(conn, wanted):
        raise TypeError(
            f"{task.name} is transactional: pass the {kind} its handler runs on, "
            f"perform_job{'_async' if wanted is psycopg.AsyncConnection else ''}(task, conn, ...)"
        )


def _transactional_failure(task: Task[Any], job: ClaimedJob, exc: Exception) -> Outcome:
    attempt = job.attempts + 1
    policy = task.options.retry
    return failure_outcome(
        job.id, attempt, job.max_attempts, policy, exc, utcnow(), random.Random()
    )


def _ensure_transaction(conn: Conn) -> None:
    """Open ``conn``'s transaction if none is: ``conn.transaction()`` is then a savepoint
    in it, not a transaction of its own that would commit."""
    if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        conn.execute(SERVER_NOW)


async def _ensure_transaction_async(conn: AsyncConn) -> None:
    if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        await conn.execute(SERVER_NOW)


def perform_job(
    task: Task[Any] | TaskCall[Any], conn: Conn | None = None, /, **args: Any
) -> JobOutcome:
    """Run ``task``'s handler once, as a worker would, and return what came of it.

    The arguments are checked and encoded as ``enqueue`` does and decoded from that JSON;
    the result goes through JSON too; ``current_job()`` is the job (id 0, attempt 1);
    ``set_progress`` is kept in the outcome; a raised exception becomes the failure a
    worker records, with the retry or dead decision. A transactional task needs ``conn``:
    its handler runs in a savepoint of ``conn``'s transaction, rolled back if it fails
    (its writes stay otherwise, for the test to read and roll back)."""
    plain = _task_of(task)
    if plain.is_async and plain.options.transactional:
        raise TypeError(f"{plain.name} is an async transactional task: use perform_job_async")
    _check_connection(plain, conn, psycopg.Connection)
    spec = task.job(**args)
    if conn is None:
        job = _performed_job(spec, attempts=1)
        progress = _Progress()
        return _outcome(job, _run(_run_leased(plain.app, job, progress)), progress.value)
    job = _performed_job(spec, attempts=0)
    _ensure_transaction(conn)
    set_current_job(job)
    try:
        with conn.transaction():
            result_json = encode_result(plain.fn(conn, **job.args))
        outcome: Outcome = Completed(job.id, job.attempts + 1, result_json)
    except Exception as exc:
        outcome = _transactional_failure(plain, job, exc)
    finally:
        set_current_job(None)
    return _outcome(job, outcome)


async def perform_job_async(
    task: Task[Any] | TaskCall[Any], conn: AsyncConn | None = None, /, **args: Any
) -> JobOutcome:
    """Async twin of ``perform_job``; a transactional task takes a psycopg.AsyncConnection."""
    plain = _task_of(task)
    if not plain.is_async and plain.options.transactional:
        raise TypeError(f"{plain.name} is a sync transactional task: use perform_job")
    _check_connection(plain, conn, psycopg.AsyncConnection)
    spec = task.job(**args)
    if conn is None:
        job = _performed_job(spec, attempts=1)
        progress = _Progress()
        return _outcome(job, await _run_leased(plain.app, job, progress), progress.value)
    job = _performed_job(spec, attempts=0)
    await _ensure_transaction_async(conn)
    set_current_job(job)
    try:
        async with conn.transaction():
            coro = plain.fn(conn, **job.args)
            result_json = encode_result(await asyncio.wait_for(coro, plain.options.timeout))
        outcome: Outcome = Completed(job.id, job.attempts + 1, result_json)
    except Exception as exc:
        outcome = _transactional_failure(plain, job, exc)
    finally:
        set_current_job(None)
    return _outcome(job, outcome)


# -- drain: every ready job, in the test's transaction -----------------------------------


@dataclass
class _Drain:
    """What a drain decides without I/O: which tasks each mode runs, the claim's
    parameters, the outcomes so far and the limit on runs."""

    app: App
    queues: Sequence[str] | None
    is_async: bool
    max_runs: int
    worker_id: uuid.UUID = dataclasses.field(default_factory=uuid.uuid4)
    outcomes: list[JobOutcome] = dataclasses.field(default_factory=list)

    @property
    def transactional(self) -> list[str]:
        return [t.name for t in self.app.tasks.values() if t.options.transactional]

    @property
    def runnable_transactional(self) -> list[str]:
        """The transactional tasks this connection can run: their handlers take it."""
        return [
            t.name
            for t in self.app.tasks.values()
            if t.options.transactional and t.is_async == self.is_async
        ]

    def claim(self, queue: str) -> tuple[str, dict[str, Any]]:
        return render(claim.JOB_CLAIM_BATCH, self.app.schema), {
            "queue": queue,
            "exclude_tasks": self.transactional,
            "limit": 1,
            "worker_id": self.worker_id,
            "lease_seconds": LEASE_SECONDS,
        }

    def writes(self, outcome: Outcome) -> list[tuple[str, dict[str, Any]]]:
        return [
            (
                render(_OUTCOME_STATEMENTS[group], self.app.schema),
                {**params, "worker_id": self.worker_id},
            )
            for group, params in outcome_writes([storable_outcome(outcome)])
        ]

    def refused(
        self, job: ClaimedJob, outcome: Outcome, refusal: BaseException
    ) -> tuple[Outcome, tuple[str, dict[str, Any]]]:
        """The failed attempt recorded when PostgreSQL refused ``outcome`` (as the
        completer records it), and the statement that writes it."""
        error = refused_error(outcome, refusal, utcnow().isoformat())
        dead = job.attempts >= job.max_attempts
        return failed(job.id, outcome.attempt, error, dead=dead, delay=0.0), (
            render(complete.JOB_FAIL_UNSTORABLE_IF_LEASED, self.app.schema),
            {
                "id": job.id,
                "attempt": outcome.attempt,
                "worker_id": self.worker_id,
                "delay": REFUSED_BACKOFF.delay(outcome.attempt, random.Random()),
                "error": Jsonb(error),
            },
        )

    def queues_from(self, ready: Iterable[Job]) -> list[str]:
        if self.queues is not None:
            return list(self.queues)
        return sorted({job.queue for job in ready})

    def add(self, outcome: JobOutcome) -> None:
        self.outcomes.append(outcome)
        if len(self.outcomes) > self.max_runs:
            raise AssertionError(
                f"drain ran {self.max_runs} jobs and more are ready: a handler that snoozes "
                "without a delay, or jobs that enqueue jobs without end? Last ones:\n"
                + "\n".join(f"  {o}" for o in self.outcomes[-5:])
            )

    def check_left(self, ready: Sequence[Job], queues: Sequence[str]) -> None:
        """Ready jobs of transactional tasks this connection cannot run: say which drain can."""
        other = {t.name for t in self.app.tasks.values() if t.options.transactional} - set(
            self.runnable_transactional
        )
        stuck = [job for job in ready if job.task in other and job.queue in queues]
        if stuck:
            wanted = (
                "drain (a psycopg.Connection)"
                if self.is_async
                else "drain_async (a psycopg.AsyncConnection)"
            )
            raise TypeError(
                f"{stuck[0].task} is {'a sync' if self.is_async else 'an async'} transactional "
                f"task, whose handler takes the connection: run its jobs with {wanted}"
            )

    def check_too_new(
        self, ready: Sequence[Job], queues: Sequence[str], now: datetime, clock: datetime
    ) -> None:
        """Ready jobs left because they were committed after the connection's transaction
        began: in it, now() is its start, so the worker's claim finds them not yet due.
        Said plainly, instead of returning as if there were nothing to run."""
        late = [job for job in ready if job.queue in queues and now < job.run_at <= clock]
        if late:
            raise AssertionError(
                f"drain left {len(late)} ready job(s) committed after this connection's "
                "transaction began: inside it, now() is the transaction's start, and these "
                "are not due yet. Drain them on a connection whose transaction starts later, "
                "e.g. psycopg.connect(url, autocommit=True) (their outcomes then commit).\n"
                + _listing(late, now, "Left")
            )

    def transactional_outcome(
        self, job: ClaimedJob, kind: str, error: dict[str, Any] | None, row: Job, now: datetime
    ) -> JobOutcome:
        """What a transactional run came to, from run_transactional_*'s report and the
        job's row as read back after it."""
        delay = 0.0
        if kind in ("retried", "snoozed"):
            delay = max((_due(row) - now).total_seconds(), 0.0)
        return JobOutcome(
            job_id=job.id,
            task=job.task,
            args=job.args,
            kind=kind,
            result=row.result,
            error=error,
            delay=delay,
        )


def _ready(conn: Conn, app: App) -> list[Job]:
    return client.list_jobs(conn, app.schema, state="available", limit=LIST_LIMIT)


async def _ready_async(conn: AsyncConn, app: App) -> list[Job]:
    # client has no async listing; the admin read is the same statement.
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            render(admin.JOB_LIST, app.schema),
            {
                "state": "available",
                "queue": None,
                "task": None,
                "older_than": None,
                "limit": LIST_LIMIT,
            },
        )
        return [client.job_from_row(row) for row in await cur.fetchall()]


def drain(
    conn: Conn, app: App, /, *, queues: Sequence[str] | None = None, max_runs: int = MAX_RUNS
) -> list[JobOutcome]:
    """Run every ready job of ``queues`` (default: every queue with ready jobs) in this
    process, until none is left, and return what each run came to, in order.

    Jobs are claimed and their outcomes written with the worker's statements, through
    ``conn``: inside its transaction, so a test's rollback undoes them. Jobs a handler
    enqueues are run too; a job retried later, scheduled or blocked behind its key is not
    ready and is left. Lease-mode handlers run as a worker runs them (threads for sync
    ones); transactional ones run on ``conn`` in a savepoint, as in a worker. Async
    transactional tasks need ``drain_async``."""
    state = _Drain(app, queues, is_async=False, max_runs=max_runs)
    _ensure_transaction(conn)
    while True:
        ready = _ready(conn, app)
        queues_now = state.queues_from(ready)
        state.check_left(ready, queues_now)
        ran = len(state.outcomes)
        for queue in queues_now:
            while _drain_leased_one(conn, state, queue) or _drain_locked_one(conn, state, queue):
                pass
        if len(state.outcomes) == ran:
            row = conn.execute(SERVER_CLOCKS).fetchone()
            assert row is not None
            state.check_too_new(ready, queues_now, *row)
            return state.outcomes


def _drain_leased_one(conn: Conn, state: _Drain, queue: str) -> bool:
    rows = conn.execute(*state.claim(queue)).fetchall()
    if not rows:
        return False
    job = claimed_from_row(rows[0])
    progress = _Progress()
    outcome = _run(_run_leased(state.app, job, progress))
    outcome = dataclasses.replace(outcome, progress_json=progress.json)
    try:
        with conn.transaction():
            for statement in state.writes(outcome):
                conn.execute(*statement)
    except (psycopg.DataError, psycopg.IntegrityError) as refusal:  # a value refused
        outcome, statement = state.refused(job, outcome, refusal)
        conn.execute(*statement)
    state.add(_outcome(job, outcome, progress.value))
    return True


def _drain_locked_one(conn: Conn, state: _Drain, queue: str) -> bool:
    tasks = state.runnable_transactional
    if not tasks:
        return False
    finished: list[tuple[ClaimedJob, str, dict[str, Any] | None]] = []
    run_transactional_sync(
        state.app,
        conn,
        queue,
        tasks,
        1,
        rng=random.Random(),
        on_finished=lambda job, outcome, seconds: finished.append(
            (job, outcome.kind, outcome.error)
        ),
    )
    for job, kind, error in finished:
        row = client.get_job(conn, state.app.schema, job.id)
        state.add(state.transactional_outcome(job, kind, error, row, _server_now(conn)))
    return bool(finished)


async def drain_async(
    conn: AsyncConn, app: App, /, *, queues: Sequence[str] | None = None, max_runs: int = MAX_RUNS
) -> list[JobOutcome]:
    """Async twin of ``drain``, on a psycopg.AsyncConnection: async transactional tasks
    run on it; sync transactional ones need ``drain``."""
    state = _Drain(app, queues, is_async=True, max_runs=max_runs)
    await _ensure_transaction_async(conn)
    while True:
        ready = await _ready_async(conn, app)
        queues_now = state.queues_from(ready)
        state.check_left(ready, queues_now)
        ran = len(state.outcomes)
        for queue in queues_now:
            while await _drain_leased_one_async(conn, state, queue) or (
                await _drain_locked_one_async(conn, state, queue)
            ):
                pass
        if len(state.outcomes) == ran:
            cur = await conn.execute(SERVER_CLOCKS)
            row = await cur.fetchone()
            assert row is not None
            state.check_too_new(ready, queues_now, *row)
            return state.outcomes


async def _drain_leased_one_async(conn: AsyncConn, state: _Drain, queue: str) -> bool:
    cur = await conn.execute(*state.claim(queue))
    rows = await cur.fetchall()
    if not rows:
        return False
    job = claimed_from_row(rows[0])
    progress = _Progress()
    outcome = await _run_leased(state.app, job, progress)
    outcome = dataclasses.replace(outcome, progress_json=progress.json)
    try:
        async with conn.transaction():
            for statement in state.writes(outcome):
                await conn.execute(*statement)
    except (psycopg.DataError, psycopg.IntegrityError) as refusal:
        outcome, statement = state.refused(job, outcome, refusal)
        await conn.execute(*statement)
    state.add(_outcome(job, outcome, progress.value))
    return True


async def _drain_locked_one_async(conn: AsyncConn, state: _Drain, queue: str) -> bool:
    tasks = state.runnable_transactional
    if not tasks:
        return False
    finished: list[tuple[ClaimedJob, str, dict[str, Any] | None]] = []
    await run_transactional_async(
        state.app,
        conn,
        queue,
        tasks,
        1,
        rng=random.Random(),
        on_finished=lambda job, outcome, seconds: finished.append(
            (job, outcome.kind, outcome.error)
        ),
    )
    for job, kind, error in finished:
        row = await client.get_job_async(conn, state.app.schema, job.id)
        cur = await conn.execute(SERVER_NOW)
        now_row = await cur.fetchone()
        assert now_row is not None
        state.add(state.transactional_outcome(job, kind, error, row, now_row[0]))
    return bool(finished)
