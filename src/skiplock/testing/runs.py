"""What running jobs in a test decides without a connection, shared by ``perform_job``
and ``drain`` and their async forms: the outcome a run came to, the job a worker would
have claimed, the checks of a call's arguments, and a drain's state. The two small pairs
here (``leased_outcome``, ``call_transactional``) differ by nature: a sync caller runs
the worker's coroutine on a loop of its own, and only an async handler can be timed out
in place."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from skiplock.app import App
from skiplock.completer import (
    REFUSED_BACKOFF,
    outcome_writes,
    refused_error,
    storable_outcome,
)
from skiplock.durable import LockedStore, MemoryStore
from skiplock.executor import claimed_from_row, failure_outcome, run_leased, utcnow
from skiplock.outcomes import OUTCOME_TYPES, Outcome, Suspended, failed
from skiplock.sql import claim, complete, render
from skiplock.storable import encode_result
from skiplock.tasks import JobSpec, Task, TaskCall
from skiplock.types import ClaimedJob, Job, JobState

T = TypeVar("T")
Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]

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
_OUTCOME_STATEMENTS = {kind.group: kind.statements[0] for kind in OUTCOME_TYPES}


@dataclass(frozen=True)
class JobOutcome:
    """What one run of a job came to.

    ``kind`` is ``completed``, ``retried``, ``dead``, ``snoozed``, ``cancelled``, or
    ``waiting`` / ``sleeping`` (the handler called wait_for / sleep);
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
        call = f"#{self.job_id} {self.task}({show_args(self.args)})"
        if self.error is not None:
            return f"{call}: {self.kind}: {self.error.get('type')}: {self.error.get('message')}"
        if self.kind == "completed":
            return f"{call}: completed -> {self.result!r}"
        return f"{call}: {self.kind}"


# -- showing jobs in a failure message ------------------------------------------------


def show_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in args.items())


def due(job: Job) -> datetime:
    if job.state is JobState.RETRYABLE and job.retry_at is not None:
        return job.retry_at
    return job.run_at


def _show_job(job: Job, now: datetime) -> str:
    wait = (due(job) - now).total_seconds()
    when = f", due in {wait:.0f}s" if wait >= 0.5 else ""
    return f"  #{job.id} {job.task}({show_args(job.args)}) queue={job.queue!r} {job.state}{when}"


def listing(jobs: Sequence[Job], now: datetime, heading: str) -> str:
    if not jobs:
        return f"{heading}: none."
    lines = [f"{heading} ({len(jobs)}):"]
    lines.extend(_show_job(job, now) for job in jobs[:SHOWN_JOBS])
    if len(jobs) > SHOWN_JOBS:
        lines.append(f"  ... and {len(jobs) - SHOWN_JOBS} more")
    return "\n".join(lines)


# -- one run ----------------------------------------------------------------------------


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end from sync code, even inside a running event loop (an async
    test calling the sync helpers): then on a loop of its own, in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="skiplock-testing") as runner:
        return runner.submit(asyncio.run, coro).result()


class Progress:
    """Where ``set_progress`` writes during a test run: the latest value wins."""

    def __init__(self) -> None:
        self.json: str | None = None

    def __call__(self, encoded: str) -> None:
        self.json = encoded

    @property
    def value(self) -> Any:
        return None if self.json is None else json.loads(self.json)


def job_outcome(job: ClaimedJob, outcome: Outcome, progress: Any = None) -> JobOutcome:
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


async def _run_leased(
    app: App, job: ClaimedJob, progress: Progress, conn: Conn | AsyncConn | None, worker_id: Any
) -> Outcome:
    """The worker's run of a lease-mode job: sync handlers in a thread, async ones on this
    loop, the task's timeout applied, a real ``current_job()``. Its steps are recorded on
    ``conn``, in the test's transaction (in memory without one); a drain's job, held by
    ``worker_id``, may wait and sleep there too."""
    threads = ThreadPoolExecutor(1, thread_name_prefix="skiplock-testing")
    steps = MemoryStore() if conn is None else LockedStore(conn, app.schema, worker_id=worker_id)
    try:
        return await run_leased(
            app, job, threads, rng=random.Random(), progress=progress, steps=steps
        )
    finally:
        threads.shutdown(wait=False)  # a handler abandoned at its timeout keeps its thread


def leased_outcome(
    app: App, job: ClaimedJob, progress: Progress, conn: Conn | None, worker_id: Any = None
) -> Outcome:
    """The worker's run of a lease-mode job, from sync code."""
    return _run(_run_leased(app, job, progress, conn, worker_id))


async def leased_outcome_async(
    app: App, job: ClaimedJob, progress: Progress, conn: AsyncConn | None, worker_id: Any = None
) -> Outcome:
    """The worker's run of a lease-mode job, on the caller's loop."""
    return await _run_leased(app, job, progress, conn, worker_id)


def call_transactional(task: Task[Any], conn: Conn, args: dict[str, Any]) -> str | None:
    """A sync transactional handler's result, encoded (no timeout: it runs in place)."""
    return encode_result(task.fn(conn, **args))


async def call_transactional_async(
    task: Task[Any], conn: AsyncConn, args: dict[str, Any]
) -> str | None:
    """An async transactional handler's result, encoded, within the task's timeout."""
    return encode_result(await asyncio.wait_for(task.fn(conn, **args), task.options.timeout))


def task_of(task: Task[Any] | TaskCall[Any]) -> Task[Any]:
    if isinstance(task, TaskCall):
        return task.task
    if isinstance(task, Task):
        return task
    raise TypeError(f"expected a skiplock task, got {type(task).__name__}")


def performed_job(spec: JobSpec, attempts: int) -> ClaimedJob:
    """The job a worker would have claimed for ``spec``: its arguments decoded from the
    JSON text enqueue would have stored."""
    now = utcnow()
    row = (0, spec.queue, spec.task, spec.args_json, spec.priority, now, attempts)
    return claimed_from_row((*row, spec.max_attempts, now))


def check_perform(task: Task[Any], conn: object, wanted: type[object]) -> None:
    """``perform_job`` (``wanted`` psycopg.Connection) or ``perform_job_async``
    (psycopg.AsyncConnection) fits ``task`` and is given what its handler takes."""
    is_async = wanted is psycopg.AsyncConnection
    if task.options.transactional and task.is_async != is_async:
        kind, other = ("a sync", "perform_job") if is_async else ("an async", "perform_job_async")
        raise TypeError(f"{task.name} is {kind} transactional task: use {other}")
    kind = "psycopg.AsyncConnection" if is_async else "psycopg.Connection"
    if not task.options.transactional:
        if conn is not None:
            raise TypeError(f"{task.name} is not transactional: its handler takes no connection")
        return
    if not isinstance(conn, wanted):
        raise TypeError(
            f"{task.name} is transactional: pass the {kind} its handler runs on, "
            f"perform_job{'_async' if is_async else ''}(task, conn, ...)"
        )


def transactional_failure(task: Task[Any], job: ClaimedJob, exc: Exception) -> Outcome:
    attempt = job.attempts + 1
    policy = task.options.retry
    return failure_outcome(
        job.id, attempt, job.max_attempts, policy, exc, utcnow(), random.Random()
    )


def needs_transaction(conn: Conn | AsyncConn) -> bool:
    """``conn`` has no transaction open, and would get none from ``conn.transaction()``
    but one of its own that commits: the caller opens it first (a savepoint then)."""
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    return not conn.autocommit and idle


# -- drain ---------------------------------------------------------------------------------


@dataclass
class Drain:
    """What a drain decides without I/O: which tasks each mode runs, the claim's
    parameters, the outcomes so far and the limit on runs. ``connection`` is the class of
    the drain's connection: psycopg.AsyncConnection runs async transactional tasks,
    psycopg.Connection sync ones."""

    app: App
    queues: Sequence[str] | None
    connection: type[object]
    max_runs: int
    worker_id: uuid.UUID = dataclasses.field(default_factory=uuid.uuid4)
    outcomes: list[JobOutcome] = dataclasses.field(default_factory=list)

    @property
    def is_async(self) -> bool:
        return self.connection is psycopg.AsyncConnection

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
            "governed": True,  # a test's drain runs one job at a time, limits aside
        }

    def writes(self, outcome: Outcome) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(outcome, Suspended):
            return []  # its handler wrote it (a wait, a sleep)
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
                + listing(late, now, "Left")
            )

    def transactional_outcome(
        self, job: ClaimedJob, kind: str, error: dict[str, Any] | None, row: Job, now: datetime
    ) -> JobOutcome:
        """What a transactional run came to, from run_transactional_*'s report and the
        job's row as read back after it."""
        delay = 0.0
        if kind in ("retried", "snoozed"):
            delay = max((due(row) - now).total_seconds(), 0.0)
        return JobOutcome(
            job_id=job.id,
            task=job.task,
            args=job.args,
            kind=kind,
            result=row.result,
            error=error,
            delay=delay,
        )
