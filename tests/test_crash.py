"""Crash safety with real worker processes: SIGKILL, SIGSTOP/SIGCONT and SIGTERM.

Each test starts ``skiplock worker tests.crash_app:app`` subprocesses and signals them
while a job is in its handler. The handlers (``tests/crash_app.py``) record every
execution in ``crash_executions`` through their own autocommit connection and, when asked
to hold, wait for the test to put their (job, attempt) in ``crash_releases``. Nothing here
sleeps to wait for a worker: it polls a condition with a deadline. Where a test needs time
to pass (a lease, a leader's term) it moves the deadline in the database instead.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

import skiplock
from conftest import wait_until
from processes import WorkerProcess, kill_all, registered_worker_id, spawn_worker_process
from skiplock.completer import fenced_batch
from skiplock.config import notify_channel
from skiplock.sql import claim, complete, maintenance, render

SCHEMA = "skiplock"
QUEUE = "crash"
LEASED = "crash.leased"
LEASED_ASYNC = "crash.leased_async"
TRANSACTIONAL = "crash.transactional"
TRANSACTIONAL_ASYNC = "crash.transactional_async"
WORKER_APP = "tests.crash_app:app"

# Bounds for things that take milliseconds when all is well; they only decide how long a
# broken run takes to fail.
STARTUP_TIMEOUT = 20.0
STEP_TIMEOUT = 20.0
# A worker that logged "stopped" has nothing left to do but close its pools.
EXIT_TIMEOUT = 5.0

T = TypeVar("T")

CRASH_TABLES = """
CREATE TABLE crash_executions (
    job_id      bigint      NOT NULL,
    attempt     integer     NOT NULL,
    pid         integer     NOT NULL,
    task        text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
CREATE TABLE crash_releases (
    job_id  bigint  NOT NULL,
    attempt integer NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
CREATE TABLE crash_effects (
    job_id bigint  NOT NULL,
    pid    integer NOT NULL
);
"""


# -- waiting and worker processes -------------------------------------------------------


SpawnWorker = Callable[..., WorkerProcess]


@pytest.fixture(scope="module")
def crash_tables(database_url: str) -> Iterator[None]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS crash_executions, crash_releases, crash_effects")
        conn.execute(CRASH_TABLES)
    yield
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE crash_executions, crash_releases, crash_effects")


@pytest.fixture
def db(
    app: skiplock.App, crash_tables: None, autocommit: psycopg.Connection[Any]
) -> psycopg.Connection[Any]:
    """The test's own autocommit connection, over empty queue and crash tables."""
    autocommit.execute("TRUNCATE crash_executions, crash_releases, crash_effects")
    autocommit.execute("DELETE FROM skiplock.leader")
    return autocommit


@pytest.fixture
def spawn_worker(
    database_url: str, db: psycopg.Connection[Any], tmp_path: Path
) -> Iterator[SpawnWorker]:
    """Start worker processes on the crash queue and wait until each has registered.
    Every one still alive at the end is killed, stopped ones included, pass or fail."""
    started: list[WorkerProcess] = []

    def spawn(
        *,
        lease: float = 30.0,
        concurrency: int = 4,
        shutdown_timeout: float = 30.0,
        prefetch: int = 0,
    ) -> WorkerProcess:
        log_path = tmp_path / f"worker-{len(started)}.log"
        worker = spawn_worker_process(
            database_url,
            WORKER_APP,
            *("--queues", QUEUE, "--concurrency", str(concurrency)),
            *("--lease", str(lease), "--shutdown-timeout", str(shutdown_timeout)),
            *("--poll-interval", "0.1", "--prefetch", str(prefetch)),
            log_path=log_path,
            env={"SKIPLOCK_DATABASE_URL": database_url},
        )
        started.append(worker)
        worker.id = wait_until(
            lambda: registered_worker_id(db, worker.pid),
            STARTUP_TIMEOUT,
            what=f"worker {worker.pid} to register",
            check=worker.check_alive,
        )
        return worker

    yield spawn
    kill_all(started)


# -- reading and steering the jobs ------------------------------------------------------


def enqueue(
    app: skiplock.App, conn: psycopg.Connection[Any], task: str, count: int = 1, **args: Any
) -> list[int]:
    spec = skiplock.JobSpec(
        task=task, args_json=json.dumps(args), queue=QUEUE, priority=0, max_attempts=5
    )
    return app.enqueue_many(conn, [spec] * count)


def release(conn: psycopg.Connection[Any], job_id: int, attempt: int) -> None:
    conn.execute("INSERT INTO crash_releases (job_id, attempt) VALUES (%s, %s)", (job_id, attempt))


def executions(conn: psycopg.Connection[Any], job_id: int) -> list[tuple[int, int, bool]]:
    """(attempt, pid, finished) of every time a handler started on the job, in order."""
    rows = conn.execute(
        "SELECT attempt, pid, finished_at IS NOT NULL FROM crash_executions"
        " WHERE job_id = %s ORDER BY started_at",
        (job_id,),
    ).fetchall()
    return [(int(a), int(p), bool(f)) for a, p, f in rows]


def effects(conn: psycopg.Connection[Any], job_id: int) -> list[int]:
    """The pids whose transactional handler's own write for the job was committed."""
    rows = conn.execute("SELECT pid FROM crash_effects WHERE job_id = %s", (job_id,)).fetchall()
    return [int(r[0]) for r in rows]


def live_job(conn: psycopg.Connection[Any], job_id: int) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT state, attempts, worker_id, lease_expires_at, errors"
        " FROM skiplock.jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    if row is None:
        return None
    return dict(
        zip(("state", "attempts", "worker_id", "lease_expires_at", "errors"), row, strict=True)
    )


def history(conn: psycopg.Connection[Any], job_id: int) -> list[tuple[str, int, Any]]:
    """(state, attempts, result) of every history row of the job."""
    rows = conn.execute(
        "SELECT state, attempts, result FROM skiplock.job_history WHERE id = %s", (job_id,)
    ).fetchall()
    return [(str(s), int(a), r) for s, a, r in rows]


def wait_stopped(worker: WorkerProcess) -> None:
    """Until the worker logs that it finished shutting down."""
    wait_until(
        lambda: f"worker {worker.id} stopped" in worker.log(),
        STEP_TIMEOUT,
        what="the worker to finish shutting down",
    )


def assert_given_back(conn: psycopg.Connection[Any], job_id: int) -> None:
    """Back in the queue at once, the cut-short attempt uncounted and noted."""
    row = live_job(conn, job_id)
    assert row is not None
    assert (row["state"], row["attempts"], row["worker_id"]) == ("available", 0, None)
    assert [(e["type"], e["attempt"]) for e in row["errors"]] == [("WorkerShutdown", 1)]


def history_errors(conn: psycopg.Connection[Any], job_id: int) -> list[tuple[str, int]]:
    """(type, attempt) of each error the finished job carries."""
    row = conn.execute(
        "SELECT errors FROM skiplock.job_history WHERE id = %s", (job_id,)
    ).fetchone()
    assert row is not None
    return [(e["type"], e["attempt"]) for e in row[0]]


def claimable(conn: psycopg.Connection[Any], job_id: int) -> list[int]:
    """The job, if no transaction holds its row lock (the lock is released at once)."""
    rows = conn.execute(
        "SELECT id FROM skiplock.jobs WHERE id = %s FOR UPDATE SKIP LOCKED", (job_id,)
    ).fetchall()
    return [int(r[0]) for r in rows]


def all_finished(conn: psycopg.Connection[Any], job_ids: Sequence[int]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM skiplock.job_history WHERE id = ANY(%s)", (list(job_ids),)
    ).fetchone()
    assert row is not None
    return int(row[0]) >= len(job_ids)


def registered_pids(conn: psycopg.Connection[Any]) -> list[int]:
    return [int(r[0]) for r in conn.execute("SELECT pid FROM skiplock.workers").fetchall()]


def end_leader_term(conn: psycopg.Connection[Any], worker: WorkerProcess) -> None:
    """Let the term of a hung (stopped) leader run out now instead of in leader_ttl."""
    conn.execute(
        "UPDATE skiplock.leader SET expires_at = now() - interval '1 second' WHERE worker_id = %s",
        (worker.id,),
    )


# -- transactional mode -----------------------------------------------------------------


@pytest.mark.parametrize("task", [TRANSACTIONAL, TRANSACTIONAL_ASYNC])
def test_killed_transactional_job_is_claimable_at_once_with_attempts_unchanged(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker, task: str
) -> None:
    (job,) = enqueue(app, db, task, hold=True)
    a = spawn_worker()
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )
    assert claimable(db, job) == [], "the running job's row lock should hide it"

    a.kill()
    wait_until(lambda: claimable(db, job), STEP_TIMEOUT, what="the dead backend's lock to go")
    row = live_job(db, job)
    assert row is not None
    assert (row["state"], row["attempts"], row["worker_id"], row["errors"]) == (
        "available",
        0,
        None,
        [],
    )
    assert effects(db, job) == [], "the killed handler's own write should have rolled back"

    # The killed attempt never counted, so the re-run is attempt 1 again.
    release(db, job, 1)
    b = spawn_worker()
    wait_until(
        lambda: history(db, job), STEP_TIMEOUT, what="the re-run to complete", check=b.check_alive
    )
    assert history(db, job) == [("completed", 1, {"pid": b.pid, "attempt": 1})]
    assert effects(db, job) == [b.pid]
    assert executions(db, job) == [(1, a.pid, False), (1, b.pid, True)]
    assert live_job(db, job) is None


def test_killed_transactional_batch_rolls_back_every_job_in_it(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """One session runs a batch in one transaction: a kill while its second job runs
    rolls back the first job's finished work too, so that job runs again (at least once)
    and the third, never started, is not lost."""
    (first,) = enqueue(app, db, TRANSACTIONAL, hold=False)
    (second,) = enqueue(app, db, TRANSACTIONAL, hold=True)
    (third,) = enqueue(app, db, TRANSACTIONAL, hold=False)
    jobs = [first, second, third]
    a = spawn_worker()
    wait_until(
        lambda: executions(db, second),
        STEP_TIMEOUT,
        what="the second job to start",
        check=a.check_alive,
    )
    assert executions(db, first) == [(1, a.pid, True)]
    assert [claimable(db, job) for job in jobs] == [[], [], []]

    a.kill()
    wait_until(
        lambda: all(claimable(db, job) for job in jobs),
        STEP_TIMEOUT,
        what="the dead backend's locks to go",
    )
    for job in jobs:
        row = live_job(db, job)
        assert row is not None
        assert (row["state"], row["attempts"], row["errors"]) == ("available", 0, [])
        assert effects(db, job) == []

    release(db, second, 1)
    b = spawn_worker()
    wait_until(
        lambda: all_finished(db, jobs),
        STEP_TIMEOUT,
        what="every job to complete",
        check=b.check_alive,
    )
    for job in jobs:
        assert history(db, job) == [("completed", 1, {"pid": b.pid, "attempt": 1})]
        assert effects(db, job) == [b.pid]
    assert executions(db, first) == [(1, a.pid, True), (1, b.pid, True)]
    assert executions(db, second) == [(1, a.pid, False), (1, b.pid, True)]
    assert executions(db, third) == [(1, b.pid, True)]


# -- lease mode -------------------------------------------------------------------------


def test_killed_leased_job_waits_for_its_lease_then_is_rescued_and_rerun(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """With no live worker to notice the death, only the lease frees the job."""
    (job,) = enqueue(app, db, LEASED, hold=True)
    a = spawn_worker(lease=2)
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )
    row = live_job(db, job)
    assert row is not None
    assert (row["state"], row["attempts"], row["worker_id"]) == ("running", 1, a.id)
    assert row["lease_expires_at"] is not None

    a.kill()
    rescue = render(maintenance.JOB_RESCUE_EXPIRED, SCHEMA)
    rescue_params = {"channel": notify_channel(SCHEMA)}
    claim_batch = render(claim.JOB_CLAIM_BATCH, SCHEMA)
    claim_params = {
        "queue": QUEUE,
        "exclude_tasks": [],
        "limit": 10,
        "worker_id": uuid.uuid4(),
        "lease_seconds": 30,
        "governed": False,
    }
    # Until the lease runs out, neither a rescue nor a claim may touch the job. Each look
    # is rolled back, and its now() is the one the statements compare against.
    before_expiry: list[tuple[list[Any], list[Any]]] = []

    def lease_expired() -> bool:
        with db.transaction(force_rollback=True):
            expired_row = db.execute(
                "SELECT lease_expires_at <= now() FROM skiplock.jobs WHERE id = %s", (job,)
            ).fetchone()
            rescued = db.execute(rescue, rescue_params).fetchall()
            claimed = db.execute(claim_batch, claim_params).fetchall()
        assert expired_row is not None
        if not expired_row[0]:
            before_expiry.append((rescued, claimed))
        return bool(expired_row[0])

    wait_until(lease_expired, STEP_TIMEOUT, what="the lease to expire")
    assert before_expiry, "the lease expired before the test could look at the job"
    assert all(seen == ([], []) for seen in before_expiry)
    row = live_job(db, job)
    assert row is not None
    assert row["state"] == "running"

    # The rescue returns (queue, jobs moved, ...) per queue it refilled.
    rescued = db.execute(rescue, rescue_params).fetchall()
    assert [(r[0], r[1]) for r in rescued] == [(QUEUE, 1)]
    row = live_job(db, job)
    assert row is not None
    assert (row["state"], row["attempts"], row["worker_id"], row["lease_expires_at"]) == (
        "available",
        1,
        None,
        None,
    )
    assert [(e["type"], e["attempt"]) for e in row["errors"]] == [("LeaseExpired", 1)]
    # The record names the attempt's worker and when it claimed the job (the dashboard's
    # timeline), read from the row as the rescue found it.
    (lost,) = row["errors"]
    assert lost["worker"] == str(a.id)
    assert datetime.fromisoformat(lost["claimed_at"]) <= datetime.fromisoformat(lost["at"])

    release(db, job, 2)
    b = spawn_worker(lease=2)
    wait_until(
        lambda: history(db, job), STEP_TIMEOUT, what="the re-run to complete", check=b.check_alive
    )
    assert history(db, job) == [("completed", 2, {"pid": b.pid, "attempt": 2})]
    assert history_errors(db, job) == [("LeaseExpired", 1)]
    assert executions(db, job) == [(1, a.pid, False), (2, b.pid, True)]


def test_a_step_recorded_before_a_kill_is_not_run_again(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """Durable steps across a SIGKILL: the 'charge' step returned and was recorded, the
    worker died in the next step, and the rescued job's second attempt gets the charge's
    recorded result instead of charging again."""
    (job,) = enqueue(app, db, "crash.stepped")
    a = spawn_worker(lease=60)
    wait_until(
        lambda: db.execute(
            "SELECT 1 FROM skiplock.job_steps WHERE job_id = %s AND name = 'charge'", (job,)
        ).fetchone(),
        STEP_TIMEOUT,
        what="the charge step to be recorded",
        check=a.check_alive,
    )

    a.kill()
    release(db, job, 2)
    b = spawn_worker(lease=60)
    wait_until(
        lambda: history(db, job), STEP_TIMEOUT, what="the re-run to complete", check=b.check_alive
    )

    assert history(db, job) == [("completed", 2, {"charged_by": a.pid, "attempt": 2})]
    effects = db.execute("SELECT pid FROM crash_effects WHERE job_id = %s", (job,)).fetchall()
    assert effects == [(a.pid,)]
    steps = db.execute(
        "SELECT name, attempt FROM skiplock.job_steps WHERE job_id = %s ORDER BY name", (job,)
    ).fetchall()
    assert steps == [("charge", 1), ("hold", 2)]


def test_jobs_in_flight_at_a_crash_run_again_and_none_is_dropped(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """A live worker sees the dead one's liveness lock go and rescues its jobs at once;
    the 60 s lease never comes into it."""
    held = enqueue(app, db, LEASED, count=3, hold=True)
    quick = enqueue(app, db, LEASED, count=5, hold=False)
    for job in held:
        release(db, job, 2)
    a = spawn_worker(lease=60, concurrency=8)
    wait_until(
        lambda: all_finished(db, quick) and all(executions(db, job) for job in held),
        STEP_TIMEOUT,
        what="the quick jobs to complete and the held ones to start",
        check=a.check_alive,
    )

    a.kill()
    b = spawn_worker(lease=60, concurrency=8)
    wait_until(
        lambda: all_finished(db, held + quick),
        STEP_TIMEOUT,
        what="every job to complete",
        check=b.check_alive,
    )

    assert db.execute("SELECT id FROM skiplock.jobs").fetchall() == []
    assert registered_pids(db) == [b.pid]
    for job in held:
        assert history(db, job) == [("completed", 2, {"pid": b.pid, "attempt": 2})]
        assert history_errors(db, job) == [("WorkerLost", 1)]
        assert executions(db, job) == [(1, a.pid, False), (2, b.pid, True)]
    for job in quick:
        assert history(db, job) == [("completed", 1, {"pid": a.pid, "attempt": 1})]
        assert history_errors(db, job) == []
        assert executions(db, job) == [(1, a.pid, True)]


def test_hung_worker_resumed_after_its_lease_expired_cannot_overwrite_the_rerun(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """A stops (hangs) holding a 2 s lease; B, once leader, rescues and re-runs the job.
    When A resumes, whichever notices first drops its stale attempt: the heartbeat (the
    lease is gone) or the completer's fenced write."""
    (job,) = enqueue(app, db, LEASED, hold=True)
    release(db, job, 2)
    a = spawn_worker(lease=2)
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )
    b = spawn_worker(lease=2)

    a.stop()

    def rerun_finished() -> list[tuple[str, int, Any]]:
        end_leader_term(db, a)  # A was elected first; a hung leader's term runs out
        return history(db, job)

    wait_until(
        rerun_finished, STEP_TIMEOUT, what="B to rescue and complete the job", check=b.check_alive
    )
    final = [("completed", 2, {"pid": b.pid, "attempt": 2})]
    assert history(db, job) == final
    # A hung but alive: its liveness lock still held, it was not taken for dead.
    assert history_errors(db, job) == [("LeaseExpired", 1)]
    assert sorted(registered_pids(db)) == sorted([a.pid, b.pid])

    release(db, job, 1)
    a.send(signal.SIGCONT)
    wait_until(
        lambda: (1, a.pid, True) in executions(db, job),
        STEP_TIMEOUT,
        what="A's handler to finish",
        check=a.check_alive,
    )
    wait_until(
        lambda: (
            f"refused stale outcome for job {job} attempt 1" in a.log()
            or f"lost the lease of job {job} attempt 1" in a.log()
        ),
        STEP_TIMEOUT,
        what="A to give up its stale attempt",
        check=a.check_alive,
    )
    assert history(db, job) == final
    assert history_errors(db, job) == [("LeaseExpired", 1)]
    assert live_job(db, job) is None
    assert executions(db, job) == [(1, a.pid, True), (2, b.pid, True)]


def test_completer_refuses_the_outcome_of_an_attempt_that_was_rescued(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """The same story with A's lease expired by the test rather than by the clock: A's
    first heartbeat is 40 s away, so its finished handler's outcome reaches the
    completer, whose fenced write must refuse it."""
    (job,) = enqueue(app, db, LEASED, hold=True)
    release(db, job, 2)
    a = spawn_worker(lease=120)
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )
    b = spawn_worker(lease=120)

    a.stop()
    db.execute(
        "UPDATE skiplock.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (job,),
    )

    def rerun_finished() -> list[tuple[str, int, Any]]:
        end_leader_term(db, a)
        return history(db, job)

    wait_until(
        rerun_finished, STEP_TIMEOUT, what="B to rescue and complete the job", check=b.check_alive
    )
    final = [("completed", 2, {"pid": b.pid, "attempt": 2})]
    assert history(db, job) == final

    release(db, job, 1)
    a.send(signal.SIGCONT)
    wait_until(
        lambda: f"refused stale outcome for job {job} attempt 1" in a.log(),
        STEP_TIMEOUT,
        what="A's completer to refuse its outcome",
        check=a.check_alive,
    )
    assert history(db, job) == final
    assert history_errors(db, job) == [("LeaseExpired", 1)]
    assert live_job(db, job) is None
    assert executions(db, job) == [(1, a.pid, True), (2, b.pid, True)]


# -- the fence, statement by statement ---------------------------------------------------


def insert_running(conn: psycopg.Connection[Any], worker_id: uuid.UUID, attempts: int) -> int:
    """A job row as a worker's claim leaves it: running, leased, attempts as the token."""
    row = conn.execute(
        "INSERT INTO skiplock.jobs"
        " (queue, task, state, attempts, worker_id, lease_expires_at, attempted_at)"
        " VALUES (%s, %s, 'running', %s, %s, now() + interval '30 seconds', now())"
        " RETURNING id",
        (QUEUE, LEASED, attempts, worker_id),
    ).fetchone()
    assert row is not None
    return int(row[0])


def live_state(conn: psycopg.Connection[Any], job_id: int) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT state, attempts, worker_id, lease_expires_at, errors"
        " FROM skiplock.jobs WHERE id = %s",
        (job_id,),
    ).fetchone()


@pytest.mark.parametrize("situation", ["rescued", "reclaimed"])
def test_every_fenced_write_refuses_a_stale_attempt(
    app: skiplock.App, conn: psycopg.Connection[Any], situation: str
) -> None:
    """Worker ``old`` ran attempt 1 and lost its lease; the job was rescued, and maybe
    re-claimed by ``new`` as attempt 2. No write keyed on a stale (worker, attempt) pair
    may touch it, alone or batched with a valid outcome."""
    old, new = uuid.uuid4(), uuid.uuid4()
    job = insert_running(conn, new, attempts=2)
    if situation == "rescued":
        conn.execute(
            "UPDATE skiplock.jobs SET state = 'available', attempts = 1, worker_id = NULL,"
            " lease_expires_at = NULL WHERE id = %s",
            (job,),
        )
    before = live_state(conn, job)

    def write(statement: str, ids: list[int], attempts: list[int], worker: uuid.UUID) -> Any:
        entries: dict[int, dict[str, Any]] = {}
        for job_id, attempt in zip(ids, attempts, strict=True):
            entry: dict[str, Any] = {"attempt": attempt, "progress": None}
            if statement == complete.JOB_COMPLETE_MANY_IF_LEASED:
                entry["result"] = '"done"'
            elif statement == complete.JOB_FAIL_MANY_IF_LEASED:
                entry.update(dead=False, delay=0.0, error={"type": "Boom", "attempt": attempt})
            elif statement == complete.JOB_SNOOZE_MANY_IF_LEASED:
                entry["delay"] = 1.0
            entries[job_id] = entry
        params: dict[str, Any] = {**fenced_batch(entries), "worker_id": worker}
        if statement == maintenance.JOB_EXTEND_LEASES_SKIP_LOCKED:
            params["lease_seconds"] = 300
        elif statement == complete.JOB_RELEASE_MANY_IF_LEASED:
            params["channel"] = f"{SCHEMA}.jobs"
        return conn.execute(render(statement, SCHEMA), params).fetchall()

    fenced = [
        complete.JOB_COMPLETE_MANY_IF_LEASED,
        complete.JOB_FAIL_MANY_IF_LEASED,
        maintenance.JOB_EXTEND_LEASES_SKIP_LOCKED,
        complete.JOB_RELEASE_MANY_IF_LEASED,
        complete.JOB_SNOOZE_MANY_IF_LEASED,
        complete.JOB_CANCEL_MANY_IF_LEASED,
    ]
    # The old worker's own attempt, the current attempt number from the wrong worker, and
    # the right worker with an old attempt number.
    for attempt, worker in ((1, old), (2, old), (1, new)):
        for statement in fenced:
            assert write(statement, [job], [attempt], worker) == []
    assert live_state(conn, job) == before
    assert history(conn, job) == []

    other = insert_running(conn, new, attempts=1)
    batch = write(complete.JOB_COMPLETE_MANY_IF_LEASED, [job, other], [1, 1], new)
    assert batch == [(other,)]
    assert live_state(conn, job) == before
    assert history(conn, job) == []
    assert history(conn, other) == [("completed", 1, "done")]


# -- shutting down ----------------------------------------------------------------------


@pytest.mark.parametrize("task", [LEASED, TRANSACTIONAL, TRANSACTIONAL_ASYNC])
def test_sigterm_lets_the_running_job_finish_then_exits_cleanly(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker, task: str
) -> None:
    (job,) = enqueue(app, db, task, hold=True)
    a = spawn_worker()
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )

    a.send(signal.SIGTERM)
    wait_until(
        lambda: f"worker {a.id} stopping" in a.log(),
        STEP_TIMEOUT,
        what="the worker to begin shutting down",
        check=a.check_alive,
    )
    assert executions(db, job) == [(1, a.pid, False)], "the job is still in its handler"

    release(db, job, 1)
    assert a.proc.wait(timeout=STEP_TIMEOUT) == 0, a.log()[-4000:]
    assert history(db, job) == [("completed", 1, {"pid": a.pid, "attempt": 1})]
    assert executions(db, job) == [(1, a.pid, True)]
    assert registered_pids(db) == []
    assert db.execute("SELECT worker_id FROM skiplock.leader").fetchall() == []


@pytest.mark.parametrize(
    ("task", "how"),
    [
        (LEASED_ASYNC, "second SIGTERM"),
        (LEASED_ASYNC, "shutdown timeout"),
        (LEASED, "second SIGTERM"),
        (LEASED, "shutdown timeout"),
    ],
)
def test_shutdown_cut_short_gives_the_attempt_back_and_exits(
    app: skiplock.App,
    db: psycopg.Connection[Any],
    spawn_worker: SpawnWorker,
    task: str,
    how: str,
) -> None:
    """A job that will not finish is released with its attempt uncounted, and the worker
    exits, whether a second signal or the shutdown timeout cuts the wait short."""
    (job,) = enqueue(app, db, task, hold=True)
    a = spawn_worker(shutdown_timeout=0.5 if how == "shutdown timeout" else 30.0)
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the handler to start", check=a.check_alive
    )

    a.send(signal.SIGTERM)
    if how == "second SIGTERM":
        wait_until(
            lambda: f"worker {a.id} stopping" in a.log(),
            STEP_TIMEOUT,
            what="the worker to begin shutting down",
            check=a.check_alive,
        )
        a.send(signal.SIGTERM)
    wait_stopped(a)
    assert_given_back(db, job)
    assert registered_pids(db) == []
    assert a.proc.wait(timeout=EXIT_TIMEOUT) == 0, a.log()[-4000:]


# -- prefetch: jobs claimed ahead are never stranded -------------------------------------


def leased_by(conn: psycopg.Connection[Any], job_ids: Sequence[int]) -> list[str | None]:
    rows = conn.execute(
        "SELECT id, worker_id FROM skiplock.jobs WHERE id = ANY(%s) ORDER BY id", (list(job_ids),)
    ).fetchall()
    return [None if r[1] is None else str(r[1]) for r in rows]


def test_prefetched_jobs_of_a_killed_worker_are_rescued_at_once(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    """One slot and two jobs claimed ahead: the prefetched jobs are leased by the worker,
    so when it dies they go back with its running job, at once, and never ran there. Their
    attempt is given back (decision 015: tests/test_prefetch_charges.py)."""
    jobs = enqueue(app, db, LEASED, count=3, hold=True)
    for job in jobs:
        release(db, job, 2)
    a = spawn_worker(lease=60, concurrency=1, prefetch=2)
    wait_until(
        lambda: (
            leased_by(db, jobs) == [str(a.id)] * 3
            and sum(bool(executions(db, job)) for job in jobs) == 1
        ),
        STEP_TIMEOUT,
        what="one job to run and two to wait prefetched",
        check=a.check_alive,
    )
    started = [job for job in jobs if executions(db, job)]

    a.kill()
    for job in jobs:
        release(db, job, 1)  # the attempt the jobs that never started run as
    b = spawn_worker(lease=60, concurrency=4)
    wait_until(
        lambda: all_finished(db, jobs), STEP_TIMEOUT, what="every job to run", check=b.check_alive
    )

    for job in jobs:
        assert history_errors(db, job) == [("WorkerLost", 1)]
        if job in started:
            # It may have been given its attempt back too: its start is recorded a
            # moment after it starts.
            assert executions(db, job)[0] == (1, a.pid, False)
            assert executions(db, job)[1:] in ([(1, b.pid, True)], [(2, b.pid, True)])
        else:
            assert executions(db, job) == [(1, b.pid, True)]


def test_sigterm_gives_prefetched_jobs_back_without_running_them(
    app: skiplock.App, db: psycopg.Connection[Any], spawn_worker: SpawnWorker
) -> None:
    jobs = enqueue(app, db, LEASED, count=3, hold=True)
    a = spawn_worker(concurrency=1, prefetch=2, shutdown_timeout=0.5)
    wait_until(
        lambda: (
            leased_by(db, jobs) == [str(a.id)] * 3
            and sum(bool(executions(db, job)) for job in jobs) == 1
        ),
        STEP_TIMEOUT,
        what="one job to run and two to wait prefetched",
        check=a.check_alive,
    )

    a.send(signal.SIGTERM)
    wait_stopped(a)
    assert a.proc.wait(timeout=EXIT_TIMEOUT) == 0, a.log()[-4000:]
    for job in jobs:
        assert_given_back(db, job)
    assert sum(len(executions(db, job)) for job in jobs) == 1
