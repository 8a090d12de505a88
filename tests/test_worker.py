"""A real worker, in process, against a real PostgreSQL.

Each test starts ``skiplock.Worker`` on its own event loop (``start_worker``), waits on
conditions with a deadline (``wait_until``) or on events, and stops it. Handlers count
their executions by ``skiplock.current_job().id``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

import skiplock
from conftest import JobFactory, Listener, StartWorker, wait_until
from skiplock import client
from skiplock.retry import RetryPolicy

MODES = ["leased-sync", "leased-async", "transactional-sync", "transactional-async"]
NO_BACK_OFF = RetryPolicy(base=0.0, cap=0.0, jitter=0.0)
# A back-off short enough not to slow a test, long enough to go through 'retryable'.
BRIEF_BACK_OFF = RetryPolicy(base=0.01, cap=0.01, jitter=0.0)
AN_HOUR = RetryPolicy(base=3600.0, cap=3600.0, jitter=0.0)


class Executions:
    """Thread-safe count of handler runs per job id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[int] = Counter()
        self.order: list[int] = []

    def record(self) -> skiplock.ClaimedJob:
        job = skiplock.current_job()
        with self._lock:
            self.counts[job.id] += 1
            self.order.append(job.id)
        return job

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())


def job_row(conn: psycopg.Connection[Any], job_id: int) -> dict[str, Any] | None:
    """The live row of a job, or None once it left the jobs table."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM skiplock.jobs WHERE id = %s", (job_id,)).fetchone()


def history_row(conn: psycopg.Connection[Any], job_id: int) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM skiplock.job_history WHERE id = %s", (job_id,)).fetchone()


def state_of(conn: psycopg.Connection[Any], job_id: int) -> str | None:
    row = conn.execute(
        "SELECT state FROM skiplock.jobs WHERE id = %(id)s "
        "UNION ALL SELECT state FROM skiplock.job_history WHERE id = %(id)s",
        {"id": job_id},
    ).fetchone()
    return None if row is None else str(row[0])


def wait_for_state(
    conn: psycopg.Connection[Any], job_id: int, state: str, timeout: float = 15.0
) -> None:
    wait_until(lambda: state_of(conn, job_id) == state, timeout, f"job {job_id} to be {state}")


def enqueue(url: str, task: skiplock.Task[Any], **args: Any) -> int:
    with psycopg.connect(url) as conn:
        return task.enqueue(conn, **args)


def test_current_job_outside_a_handler_raises() -> None:
    # A fresh context: what other tests ran in this thread cannot leak into it.
    with pytest.raises(RuntimeError, match="outside a running job"):
        contextvars.Context().run(skiplock.current_job)


# -- exactly once ----------------------------------------------------------------------


def define_counting_task(
    app: skiplock.App, mode: str, executions: Executions
) -> skiplock.Task[Any]:
    transactional = mode.startswith("transactional")
    options: dict[str, Any] = {"name": "count", "transactional": transactional}
    if mode == "leased-sync":

        def count(n: int) -> int:
            executions.record()
            return n

        return app.task(**options)(count)
    if mode == "leased-async":

        async def count_async(n: int) -> int:
            executions.record()
            await asyncio.sleep(0)
            return n

        return app.task(**options)(count_async)
    if mode == "transactional-sync":

        def count_in(conn: psycopg.Connection[Any], n: int) -> int:
            executions.record()
            return n

        return app.task(**options)(count_in)

    async def count_in_async(conn: psycopg.AsyncConnection[Any], n: int) -> int:
        executions.record()
        await asyncio.sleep(0)
        return n

    return app.task(**options)(count_in_async)


@pytest.mark.parametrize("mode", MODES)
def test_many_workers_run_every_job_exactly_once(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    mode: str,
) -> None:
    workers, jobs = 3, 300
    executions = Executions()
    task = define_counting_task(app, mode, executions)
    for _ in range(workers):
        start_worker(app, concurrency=4, poll_interval=0.05)

    with psycopg.connect(app.database_url) as conn:
        ids = app.enqueue_many(conn, [task.job(n=n) for n in range(jobs)])

    wait_until(
        lambda: (
            autocommit.execute("SELECT count(*) FROM skiplock.job_history").fetchone() == (jobs,)
        ),
        30.0,
        f"{jobs} completed jobs",
    )
    assert sorted(executions.counts) == sorted(ids)
    assert set(executions.counts.values()) == {1}
    per_id = autocommit.execute(
        "SELECT id, count(*), min(state), min(attempts), min(result::text) "
        "FROM skiplock.job_history GROUP BY id"
    ).fetchall()
    assert sorted(row[0] for row in per_id) == sorted(ids)
    assert {row[1:4] for row in per_id} == {(1, "completed", 1)}
    results = {row[0]: row[4] for row in per_id}
    assert [results[job_id] for job_id in ids] == [str(n) for n in range(jobs)]
    assert autocommit.execute("SELECT count(*) FROM skiplock.jobs").fetchone() == (0,)


# -- failures --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_failure_is_stored_counted_and_backed_off(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any], kind: str
) -> None:
    def decline(order_id: int) -> None:
        raise ValueError(f"card declined for order {order_id}")

    async def decline_async(order_id: int) -> None:
        raise ValueError(f"card declined for order {order_id}")

    handler: Any = decline if kind == "sync" else decline_async
    task = app.task(name="charge", max_attempts=3, retry=AN_HOUR)(handler)
    start_worker(app, poll_interval=0.05)

    job_id = enqueue(app.database_url, task, order_id=42)
    enqueued = job_row(autocommit, job_id)
    assert enqueued is not None

    wait_for_state(autocommit, job_id, "retryable")
    row = job_row(autocommit, job_id)
    assert row is not None
    assert row["attempts"] == 1
    assert row["worker_id"] is None
    assert row["lease_expires_at"] is None
    [error] = row["errors"]
    assert error["attempt"] == 1
    assert error["type"] == "ValueError"
    assert error["message"] == "card declined for order 42"
    assert "ValueError: card declined for order 42" in error["traceback"]
    assert "decline" in error["traceback"]
    # The back-off (an hour, no jitter) counts from the failure, which follows the claim;
    # run_at is the job's place in line and stays as it was.
    waited = row["retry_at"] - row["attempted_at"]
    assert timedelta(hours=1) <= waited < timedelta(hours=1, minutes=1)
    assert row["run_at"] == enqueued["run_at"]


@pytest.mark.parametrize("mode", ["leased-sync", "transactional-async"])
def test_after_max_attempts_the_job_is_dead_until_retried_by_hand(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any], mode: str
) -> None:
    failing = threading.Event()
    failing.set()
    executions = Executions()

    def check() -> str:
        job = executions.record()
        if failing.is_set():
            raise RuntimeError(f"upstream down (attempt {job.attempts})")
        return "sent"

    if mode == "leased-sync":

        def send(to: str) -> str:
            return check()

        task: skiplock.Task[Any] = app.task(name="send", max_attempts=2, retry=BRIEF_BACK_OFF)(send)
    else:

        async def send_in(conn: psycopg.AsyncConnection[Any], to: str) -> str:
            return check()

        task = app.task(name="send", max_attempts=2, retry=BRIEF_BACK_OFF, transactional=True)(
            send_in
        )
    start_worker(app, poll_interval=0.05)

    job_id = enqueue(app.database_url, task, to="ops@example.com")

    wait_for_state(autocommit, job_id, "dead")
    dead = job_row(autocommit, job_id)
    assert dead is not None
    assert dead["attempts"] == 2
    assert [(e["attempt"], e["type"]) for e in dead["errors"]] == [
        (1, "RuntimeError"),
        (2, "RuntimeError"),
    ]
    assert "upstream down" in dead["errors"][-1]["message"]
    assert executions.total() == 2

    failing.clear()
    with psycopg.connect(app.database_url) as conn:
        client.retry_job(conn, app.schema, job_id)

    wait_for_state(autocommit, job_id, "completed")
    done = history_row(autocommit, job_id)
    assert done is not None
    assert done["attempts"] == 1
    assert done["result"] == "sent"
    assert len(done["errors"]) == 2  # the dead job's story survives the retry
    assert executions.counts[job_id] == 3


def test_a_failure_without_back_off_runs_again_at_the_next_poll(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    executions = Executions()

    @app.task(name="flaky", max_attempts=2, retry=NO_BACK_OFF)
    def flaky() -> None:
        if executions.record().attempts == 1:
            raise RuntimeError("first attempt fails")

    start_worker(app, poll_interval=0.05, sweep_interval=60.0)

    job_id = enqueue(app.database_url, flaky)

    wait_for_state(autocommit, job_id, "completed", timeout=5.0)
    assert executions.total() == 2


def test_a_job_for_an_unknown_task_fails_naming_it_and_the_worker_goes_on(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    make_job: JobFactory,
) -> None:
    executions = Executions()

    @app.task(name="known")
    def known(n: int) -> None:
        executions.record()

    start_worker(app, poll_interval=0.05)
    before = enqueue(app.database_url, known, n=1)
    unknown = make_job(task="no.such.task", args={"n": 2}, max_attempts=1)
    after = enqueue(app.database_url, known, n=3)

    wait_for_state(autocommit, unknown, "dead")
    wait_for_state(autocommit, before, "completed")
    wait_for_state(autocommit, after, "completed")
    row = job_row(autocommit, unknown)
    assert row is not None
    [error] = row["errors"]
    assert error["type"] == "UnknownTaskError"
    assert "no.such.task" in error["message"]
    # And it keeps going after the failure was recorded.
    later = enqueue(app.database_url, known, n=4)
    wait_for_state(autocommit, later, "completed")
    assert sorted(executions.counts) == sorted([before, after, later])


@pytest.mark.parametrize("mode", MODES)
def test_rows_with_arguments_that_do_not_fit_fail_with_the_type_error(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    make_job: JobFactory,
    mode: str,
) -> None:
    if mode == "leased-sync":

        def add(a: int, b: int) -> int:
            return a + b

        handler: Any = add
    elif mode == "leased-async":

        async def add_async(a: int, b: int) -> int:
            return a + b

        handler = add_async
    elif mode == "transactional-sync":

        def add_in(conn: psycopg.Connection[Any], a: int, b: int) -> int:
            return a + b

        handler = add_in
    else:

        async def add_in_async(conn: psycopg.AsyncConnection[Any], a: int, b: int) -> int:
            return a + b

        handler = add_in_async
    app.task(name="add", transactional=mode.startswith("transactional"))(handler)
    start_worker(app, poll_interval=0.05)

    missing = make_job(task="add", args={"a": 1}, max_attempts=1)
    extra = make_job(task="add", args={"a": 1, "b": 2, "c": 3}, max_attempts=1)
    fine = make_job(task="add", args={"a": 1, "b": 2}, max_attempts=1)

    wait_for_state(autocommit, missing, "dead")
    wait_for_state(autocommit, extra, "dead")
    wait_for_state(autocommit, fine, "completed")
    for job_id, name in ((missing, "'b'"), (extra, "'c'")):
        row = job_row(autocommit, job_id)
        assert row is not None
        [error] = row["errors"]
        assert error["type"] == "TypeError"
        assert name in error["message"]
    done = history_row(autocommit, fine)
    assert done is not None
    assert done["result"] == 3


# -- transactional mode ----------------------------------------------------------------


@pytest.fixture
def effects_table(autocommit: psycopg.Connection[Any]) -> Iterator[sql.Identifier]:
    """A table for handlers' own writes; dropped after the test."""
    table = sql.Identifier(f"effects_{uuid.uuid4().hex[:10]}")
    autocommit.execute(sql.SQL("CREATE TABLE {} (n int NOT NULL)").format(table))
    yield table
    autocommit.execute(sql.SQL("DROP TABLE {}").format(table))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_transactional_handlers_writes_commit_if_and_only_if_the_job_completes(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    effects_table: sql.Identifier,
    kind: str,
) -> None:
    insert = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(effects_table)

    def record(conn: psycopg.Connection[Any], n: int, fail: bool) -> None:
        conn.execute(insert, (n,))
        if fail:
            raise RuntimeError(f"failed after writing {n}")

    async def record_async(conn: psycopg.AsyncConnection[Any], n: int, fail: bool) -> None:
        await conn.execute(insert, (n,))
        if fail:
            raise RuntimeError(f"failed after writing {n}")

    handler: Any = record if kind == "sync" else record_async
    task = app.task(name="record", transactional=True, max_attempts=1)(handler)
    start_worker(app, poll_interval=0.05)

    with psycopg.connect(app.database_url) as conn:
        ok_id = task.enqueue(conn, n=1, fail=False)
        failed_id = task.enqueue(conn, n=2, fail=True)
        also_ok_id = task.enqueue(conn, n=3, fail=False)

    wait_for_state(autocommit, ok_id, "completed")
    wait_for_state(autocommit, failed_id, "dead")
    wait_for_state(autocommit, also_ok_id, "completed")
    written = autocommit.execute(sql.SQL("SELECT n FROM {} ORDER BY n").format(effects_table))
    assert written.fetchall() == [(1,), (3,)]
    failed = job_row(autocommit, failed_id)
    assert failed is not None
    assert failed["attempts"] == 1
    assert [(e["type"], e["message"]) for e in failed["errors"]] == [
        ("RuntimeError", "failed after writing 2")
    ]


# -- steering from the handler ---------------------------------------------------------


@pytest.mark.parametrize("form", ["seconds", "timedelta", "datetime"])
def test_retry_after_from_a_handler_schedules_the_next_attempt(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any], form: str
) -> None:
    @app.task(name="poll_partner", max_attempts=5)
    def poll_partner() -> None:
        forms: dict[str, float | timedelta | datetime] = {
            "seconds": 7200.0,
            "timedelta": timedelta(hours=2),
            "datetime": datetime.now(UTC) + timedelta(hours=2),
        }
        raise skiplock.Retry(after=forms[form], reason="partner not ready")

    start_worker(app, poll_interval=0.05)

    job_id = enqueue(app.database_url, poll_partner)

    wait_for_state(autocommit, job_id, "retryable")
    row = job_row(autocommit, job_id)
    assert row is not None
    assert row["attempts"] == 1
    assert [(e["type"], e["message"]) for e in row["errors"]] == [("Retry", "partner not ready")]
    waited = row["retry_at"] - row["attempted_at"]
    assert timedelta(hours=2) - timedelta(seconds=1) <= waited < timedelta(hours=2, minutes=1)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_handler_asking_to_retry_soon_runs_again(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any], kind: str
) -> None:
    executions = Executions()

    def first_not_yet() -> str:
        job = executions.record()
        if job.attempts < 2:
            raise skiplock.Retry(after=0.01)
        return f"done on attempt {job.attempts}"

    async def first_not_yet_async() -> str:
        return first_not_yet()

    handler: Any = first_not_yet if kind == "sync" else first_not_yet_async
    task = app.task(name="later", max_attempts=3)(handler)
    start_worker(app, poll_interval=0.05)

    job_id = enqueue(app.database_url, task)

    wait_for_state(autocommit, job_id, "completed")
    done = history_row(autocommit, job_id)
    assert done is not None
    assert done["attempts"] == 2
    assert done["result"] == "done on attempt 2"
    assert [e["type"] for e in done["errors"]] == ["Retry"]


@pytest.mark.parametrize("mode", ["leased-sync", "transactional-async"])
def test_a_snoozed_job_runs_again_without_using_an_attempt(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any], mode: str
) -> None:
    executions = Executions()

    def snooze_twice() -> str:
        executions.record()
        if executions.total() <= 2:
            raise skiplock.Snooze(after=0.01)
        return "woke"

    if mode == "leased-sync":

        def wait_for_window() -> str:
            return snooze_twice()

        task: skiplock.Task[Any] = app.task(name="window", max_attempts=1)(wait_for_window)
    else:

        async def wait_for_window_in(conn: psycopg.AsyncConnection[Any]) -> str:
            return snooze_twice()

        task = app.task(name="window", max_attempts=1, transactional=True)(wait_for_window_in)
    start_worker(app, poll_interval=0.05)

    job_id = enqueue(app.database_url, task)

    # With one attempt allowed, two snoozes that counted would have left the job dead.
    wait_for_state(autocommit, job_id, "completed")
    done = history_row(autocommit, job_id)
    assert done is not None
    assert (done["attempts"], done["result"]) == (1, "woke")
    assert executions.total() == 3


def test_an_async_handler_past_its_timeout_fails(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    @app.task(name="slow", timeout=0.1, max_attempts=1)
    async def slow() -> None:
        await asyncio.sleep(60)

    start_worker(app, poll_interval=0.05)

    job_id = enqueue(app.database_url, slow)

    wait_for_state(autocommit, job_id, "dead")
    row = job_row(autocommit, job_id)
    assert row is not None
    assert [e["type"] for e in row["errors"]] == ["JobTimeoutError"]


def test_results_are_stored_as_json_or_as_their_repr(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    @app.task(name="total")
    def total(items: list[int]) -> dict[str, int]:
        return {"total": sum(items)}

    @app.task(name="odd")
    def odd() -> set[int]:
        return {1}

    start_worker(app, poll_interval=0.05)
    total_id = enqueue(app.database_url, total, items=[1, 2, 3])
    odd_id = enqueue(app.database_url, odd)

    wait_for_state(autocommit, total_id, "completed")
    wait_for_state(autocommit, odd_id, "completed")
    assert (history_row(autocommit, total_id) or {})["result"] == {"total": 6}
    assert (history_row(autocommit, odd_id) or {})["result"] == {"repr": "{1}"}


def test_a_job_reference_waits_for_the_result_or_the_failure(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    @app.task(name="square", max_attempts=1)
    def square(n: int) -> int:
        if n < 0:
            raise ValueError("no negative squares here")
        return n * n

    start_worker(app, poll_interval=0.05)
    with psycopg.connect(app.database_url) as conn:
        good = square.enqueue(conn, n=7)
        bad = square.enqueue(conn, n=-1)

    async def result_async() -> Any:
        return await good.result_async(timeout=15)

    assert good.result(timeout=15) == 49
    assert asyncio.run(result_async()) == 49
    with pytest.raises(skiplock.JobFailedError, match="no negative squares here"):
        bad.result(timeout=15)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_cancelling_a_running_job_stops_it_and_records_it_cancelled(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any], kind: str
) -> None:
    started = threading.Event()

    def until_cancelled() -> str:
        started.set()
        # Sync handlers cannot be interrupted: they look at the flag now and then.
        wait_until(skiplock.cancel_requested, 15.0, "the cancel request")
        return "stopped early"

    async def forever() -> None:
        started.set()
        await asyncio.sleep(60)  # async handlers are cancelled outright

    handler: Any = until_cancelled if kind == "sync" else forever
    task = app.task(name="long", max_attempts=3)(handler)
    start_worker(app, poll_interval=0.05)
    job_id = enqueue(app.database_url, task)
    assert started.wait(15)

    with psycopg.connect(app.database_url) as conn:
        client.cancel_job(conn, app.schema, job_id)

    wait_until(
        lambda: state_of(autocommit, job_id) in ("cancelled", "completed"),
        15.0,
        "the job to stop",
    )
    assert job_row(autocommit, job_id) is None
    done = history_row(autocommit, job_id)
    assert done is not None
    # A sync handler cannot be interrupted; it sees cancel_requested() and returns early.
    # Either way the job ends cancelled, as the requester was told.
    assert done["state"] == "cancelled"


# -- order and wake-ups ----------------------------------------------------------------


def test_with_one_slot_lower_priority_values_run_first(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    executions = Executions()

    @app.task(name="step")
    def step(n: int) -> None:
        executions.record()

    # Seven inserts on one connection: psycopg would prepare the sixth, which PgBouncer
    # before 1.21 cannot track (tests/pooler runs this test through one).
    with psycopg.connect(app.database_url, prepare_threshold=None) as conn:
        by_id = {
            step.with_options(priority=priority).enqueue(conn, n=n): priority
            for n, priority in enumerate([0, 5, -3, 10, 5, -3, 0])
        }

    start_worker(app, concurrency=1, poll_interval=0.05)

    wait_until(lambda: executions.total() == len(by_id), 15.0, "every job to run")
    assert executions.order == sorted(by_id, key=lambda job_id: (by_id[job_id], job_id))


def test_a_plain_sql_insert_wakes_an_idle_worker(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    executions = Executions()

    @app.task(name="wake")
    def wake(n: int) -> None:
        executions.record()

    # Polling every 30 s: only the notification can explain a pickup within the wait.
    start_worker(app, poll_interval=30.0)

    for n in (1, 2):
        row = autocommit.execute(
            "INSERT INTO skiplock.jobs (task, args) VALUES ('wake', %s) RETURNING id",
            (Jsonb({"n": n}),),
        ).fetchone()
        assert row is not None
        wait_for_state(autocommit, row[0], "completed", timeout=10.0)

    assert executions.total() == 2


def test_polling_finds_a_job_whose_notification_was_lost(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    listener: Listener,
) -> None:
    executions = Executions()

    @app.task(name="quiet")
    def quiet() -> None:
        executions.record()

    start_worker(app, poll_interval=0.2)

    # With replication role 'replica' ordinary triggers do not fire: no NOTIFY at all.
    with psycopg.connect(app.database_url) as conn:
        conn.execute("SET LOCAL session_replication_role = replica")
        row = conn.execute(
            "INSERT INTO skiplock.jobs (task) VALUES ('quiet') RETURNING id"
        ).fetchone()
    assert row is not None
    # Nothing announced the job. (A worker whose poll claims it while it is its queue's
    # sentinel then tells the others it is not any more: a hand-over, at the lowest
    # priority, decision 023.)
    assert [p for p in listener.collect_payloads() if "\t32767\t" not in p] == []

    wait_for_state(autocommit, row[0], "completed")
    assert executions.total() == 1


def test_a_scheduled_job_runs_once_due_and_not_before(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    started: list[datetime] = []

    @app.task(name="reminder")
    def reminder() -> None:
        started.append(datetime.now(UTC))

    start_worker(app, poll_interval=0.1)

    with psycopg.connect(app.database_url) as conn:
        job_id = reminder.with_options(delay=0.5).enqueue(conn)
    row = job_row(autocommit, job_id)
    assert row is not None
    assert row["state"] == "scheduled"

    wait_for_state(autocommit, job_id, "completed")
    assert len(started) == 1
    assert started[0] >= row["run_at"]


# -- stopping --------------------------------------------------------------------------


def blocking_task(app: skiplock.App) -> tuple[skiplock.Task[Any], threading.Event, threading.Event]:
    """A task whose handler signals when it starts and then waits for the gate."""
    started, gate = threading.Event(), threading.Event()

    @app.task(name="block")
    def block() -> str:
        started.set()
        gate.wait(30)
        return "finished"

    return block, started, gate


def test_a_graceful_stop_waits_for_the_running_job_and_records_it(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="skiplock.worker")
    block, started, gate = blocking_task(app)
    handle = start_worker(app, poll_interval=0.05, shutdown_timeout=30.0)
    job_id = enqueue(app.database_url, block)
    assert started.wait(15)

    try:
        handle.request_stop()
        wait_until(
            lambda: any("stopping" in r.getMessage() for r in caplog.records),
            10.0,
            "the worker to begin stopping",
        )
        assert handle.alive  # still waiting for the job
    finally:
        gate.set()
    handle.join()

    done = history_row(autocommit, job_id)
    assert done is not None
    assert (done["state"], done["result"], done["errors"]) == ("completed", "finished", [])


@pytest.mark.parametrize("shutdown_timeout", [0.2, 0.0])
def test_a_job_still_running_at_the_shutdown_timeout_is_given_back(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    shutdown_timeout: float,
) -> None:
    block, started, gate = blocking_task(app)
    handle = start_worker(app, poll_interval=0.05, shutdown_timeout=shutdown_timeout)
    job_id = enqueue(app.database_url, block)
    assert started.wait(15)

    try:
        handle.request_stop()
        # The handler is still blocked: only the timeout can end the stop.
        wait_until(lambda: not handle.alive, 10.0, "the worker to stop at its timeout")
    finally:
        gate.set()
    handle.join()

    # Cut short, not failed: back to the queue at once, the attempt not counted.
    row = job_row(autocommit, job_id)
    assert row is not None
    assert (row["state"], row["attempts"], row["worker_id"]) == ("available", 0, None)
    assert [e["type"] for e in row["errors"]] == ["WorkerShutdown"]


# -- the claim cursor's probe ----------------------------------------------------------


@pytest.mark.parametrize("probe", [True, False])
def test_a_job_behind_the_cursor_that_nobody_announced_is_found_by_the_probe(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    probe: bool,
) -> None:
    """A ready job can appear behind the claim cursor with no notification (here: made
    available by a plain UPDATE, which fires no trigger, and a row from before 0021, with
    no inserting transaction on record, so the late-commit read of decision 023 cannot
    see it either). Claims resume after the cursor and never see it; the background probe
    finds it and rewinds. With the probe slowed to once a minute, the same job stays put:
    the probe, not a poll, found it."""
    executions = Executions()

    @app.task(name="mark")
    def mark(n: int) -> None:
        executions.record()

    start_worker(app, poll_interval=0.05, sweep_interval=0.2 if probe else 60.0)
    first = enqueue(app.database_url, mark, n=1)
    wait_for_state(autocommit, first, "completed")
    # Scheduled far ahead (its notification's position is in the future: no rewind), then
    # moved behind the cursor by hand, silently.
    with psycopg.connect(app.database_url) as conn:
        hidden = mark.with_options(delay=3600).enqueue(conn, n=2)
    autocommit.execute(
        "UPDATE skiplock.jobs SET state = 'available', run_at = now() - interval '1 hour', "
        "enqueued_xid = NULL WHERE id = %s",
        (hidden,),
    )
    # Later jobs keep the cursor moving past it.
    later = enqueue(app.database_url, mark, n=3)
    wait_for_state(autocommit, later, "completed")

    if probe:
        wait_for_state(autocommit, hidden, "completed", timeout=10.0)
    else:
        # Polls come every 50 ms; a second of them must not find it.
        wait_until(lambda: executions.total() >= 2, 5.0, "the later job")
        threading.Event().wait(1.0)
        assert state_of(autocommit, hidden) == "available"


def test_a_job_at_the_cursors_own_position_made_ready_again_is_found_by_the_probe(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    """The cursor rests on the last job claimed; claims resume strictly after it. That job,
    dead, made available again by a plain UPDATE (no trigger, no notification), sits at
    the cursor's position, not behind it: the probe must find it too."""
    attempts: list[int] = []

    @app.task(name="flaky_once", max_attempts=1)
    def flaky_once() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")

    start_worker(app, poll_interval=0.05, sweep_interval=0.2)
    job_id = enqueue(app.database_url, flaky_once)
    wait_for_state(autocommit, job_id, "dead")
    autocommit.execute(
        "UPDATE skiplock.jobs SET state = 'available', attempts = 0 WHERE id = %s", (job_id,)
    )
    wait_for_state(autocommit, job_id, "completed", timeout=10.0)
    assert attempts == [1, 1]


# -- prefetch --------------------------------------------------------------------------


def test_prefetch_claims_ahead_but_never_runs_more_than_the_concurrency(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    lock = threading.Lock()
    running = 0
    most = 0
    claimed_ahead = 0
    probe: psycopg.Connection[Any]

    @app.task(name="overlap")
    async def overlap(n: int) -> None:
        nonlocal running, most, claimed_ahead
        with lock:
            running += 1
            most = max(most, running)
        row = probe.execute("SELECT count(*) FROM skiplock.jobs WHERE state = 'running'").fetchone()
        assert row is not None
        with lock:
            claimed_ahead = max(claimed_ahead, int(row[0]))
        await asyncio.sleep(0.02)
        with lock:
            running -= 1

    start_worker(app, concurrency=2, prefetch=3, poll_interval=0.05)
    with psycopg.connect(app.database_url, autocommit=True) as probe:
        with psycopg.connect(app.database_url) as conn:
            ids = app.enqueue_many(conn, [overlap.job(n=n) for n in range(30)])
        for job_id in ids:
            wait_for_state(autocommit, job_id, "completed")
    assert most == 2, (most, claimed_ahead)
    # Leased ahead of free slots: more jobs running in the table than the concurrency.
    # (No upper bound here: finished jobs stay 'running' until the completer writes them.)
    assert claimed_ahead > 2, (most, claimed_ahead)
