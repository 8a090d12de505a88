"""Liveness: a worker is taken for dead only once none of its sessions is left.

A worker's listener connection can drop while the worker is healthy: a server's
``idle_session_timeout``, a proxy, a DBA's ``pg_terminate_backend``, a network blip. Its
running jobs must not be rescued and run again for that. Every connection the worker
opens for its own duties holds a shared advisory lock on the worker's key; the rescuer's
exclusive try-lock succeeds only once the last of them has closed (decision 014).

The behaviour tests run real ``skiplock worker tests.crash_app:app`` processes, whose
handlers record each start in ``crash_executions`` and hold until the test releases them
(see test_crash.py). The statement tests hold the sessions themselves.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import skiplock
from conftest import StartWorker, wait_until
from processes import WorkerProcess, kill_all, registered_worker_id, spawn_worker_process
from skiplock.sql import maintenance, render
from test_crash import (
    CRASH_TABLES,
    LEASED,
    QUEUE,
    STARTUP_TIMEOUT,
    STEP_TIMEOUT,
    WORKER_APP,
    enqueue,
    executions,
    history,
    history_errors,
    release,
)

pytestmark = pytest.mark.server_version

SCHEMA = "skiplock"
# A queue with no jobs: the leader that serves it only elects itself and rescues.
LEADER_QUEUE = "liveness"
# The server ends the cut worker's listener after this long without a statement.
IDLE_SESSION_TIMEOUT_MS = 2000
ROUNDS = 4
# After each idle cut the test keeps cutting the listener (pg_terminate_backend on every
# new one) for this long: a proxy dropping that one connection, longer than a rescue pass.
BLIP_SECONDS = 1.5


# -- worker processes ---------------------------------------------------------------------

Spawn = Callable[..., WorkerProcess]


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
    autocommit.execute("TRUNCATE crash_executions, crash_releases, crash_effects")
    return autocommit


@pytest.fixture
def spawn(database_url: str, db: psycopg.Connection[Any], tmp_path: Path) -> Iterator[Spawn]:
    """Start ``skiplock worker`` processes and wait until each has registered; every one
    is SIGKILLed at the end, stopped ones too."""
    started: list[WorkerProcess] = []

    def start(
        *, queues: str = QUEUE, concurrency: int = 4, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        worker = spawn_worker_process(
            database_url,
            WORKER_APP,
            *("--queues", queues, "--concurrency", str(concurrency)),
            *("--lease", "30", "--poll-interval", "0.1"),
            log_path=tmp_path / f"worker-{len(started)}.log",
            # the worker names its sessions itself
            env={"SKIPLOCK_DATABASE_URL": database_url, "PGAPPNAME": None, **(env or {})},
        )
        started.append(worker)

        worker.id = wait_until(
            lambda: registered_worker_id(db, worker.pid),
            STARTUP_TIMEOUT,
            what=f"worker {worker.pid} to register",
            check=worker.check_alive,
        )
        return worker

    yield start
    kill_all(started)


def leader(db: psycopg.Connection[Any]) -> uuid.UUID | None:
    row = db.execute("SELECT worker_id FROM skiplock.leader").fetchone()
    return None if row is None else uuid.UUID(str(row[0]))


def spawn_leader(db: psycopg.Connection[Any], spawn: Spawn) -> WorkerProcess:
    """A worker that leads (so rescues every second) and runs none of the test's jobs."""
    db.execute("DELETE FROM skiplock.leader")
    b = spawn(queues=LEADER_QUEUE)
    wait_until(lambda: leader(db) == b.id, STEP_TIMEOUT, what="B to lead", check=b.check_alive)
    return b


def session_pids(
    db: psycopg.Connection[Any], worker: WorkerProcess, purpose: str = "%"
) -> list[int]:
    """Backends of the worker's own sessions (named ``skiplock <purpose> <worker id>``)."""
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"skiplock {purpose} {worker.id}",),
    ).fetchall()
    return [int(r[0]) for r in rows]


def started_twice(db: psycopg.Connection[Any], jobs: Sequence[int]) -> dict[int, list[Any]]:
    """Jobs whose handler started more than once, with every start."""
    runs = {job: executions(db, job) for job in jobs}
    return {job: starts for job, starts in runs.items() if len(starts) > 1}


class ListenerCuts:
    """Watches one worker's listener (by its session name) and cuts it."""

    def __init__(self, db: psycopg.Connection[Any], worker: WorkerProcess) -> None:
        self.db = db
        self.worker = worker
        self.terminated: set[int] = set()
        self.idle_cuts = 0

    def current(self) -> int | None:
        pids = session_pids(self.db, self.worker, "listener")
        assert len(pids) <= 1, f"two listeners: {pids}"
        return pids[0] if pids else None

    def wait_listening(self, than: int | None = None) -> int:
        """The listener's pid, once there is one other than ``than``."""
        return wait_until(
            lambda: (pid := self.current()) is not None and pid != than and pid,
            STEP_TIMEOUT,
            what="the listener to connect again",
            check=self.worker.check_alive,
        )

    def wait_idle_cut(self) -> None:
        """Until the server ends the listener on its own (nothing else cuts it)."""
        before = self.wait_listening()
        assert before not in self.terminated
        self.wait_listening(than=before)
        self.idle_cuts += 1

    def terminate_for(self, seconds: float) -> None:
        """pg_terminate_backend on the listener, and on each new one, for ``seconds``."""
        self.terminate(self.wait_listening())
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.worker.check_alive()
            pid = self.current()
            if pid is not None and pid not in self.terminated:
                self.terminate(pid)
            time.sleep(0.01)  # the test's own polling pace, not a wait for the worker

    def terminate(self, pid: int) -> None:
        self.db.execute("SELECT pg_terminate_backend(%s)", (pid,))
        self.terminated.add(pid)


# -- a cut listener ---------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_listener_cut_again_and_again_never_makes_a_running_job_run_twice(
    app: skiplock.App, db: psycopg.Connection[Any], spawn: Spawn
) -> None:
    """Six long jobs run on A while its listener is cut, by the server's
    idle_session_timeout and by pg_terminate_backend, and B rescues every second. The
    listener is the only one of A's sessions that takes the server's defaults (PGOPTIONS):
    the pools and the heartbeat set options of their own."""
    b = spawn_leader(db, spawn)
    a = spawn(
        concurrency=6, env={"PGOPTIONS": f"-c idle_session_timeout={IDLE_SESSION_TIMEOUT_MS}"}
    )
    jobs = enqueue(app, db, LEASED, count=6, hold=True)
    wait_until(
        lambda: all(executions(db, job) for job in jobs),
        STEP_TIMEOUT,
        what="every job to start on A",
        check=(a.check_alive, b.check_alive),
    )

    cuts = ListenerCuts(db, a)
    for _ in range(ROUNDS):
        cuts.wait_idle_cut()
        cuts.terminate_for(BLIP_SECONDS)
    assert cuts.idle_cuts == ROUNDS and len(cuts.terminated) >= ROUNDS
    # Every cut is logged: the last one's line may still be on its way (a loaded machine).
    wait_until(
        lambda: a.log().count("listener connection lost") >= ROUNDS + len(cuts.terminated),
        STEP_TIMEOUT,
        what="a log line for every listener cut",
        check=a.check_alive,
    )

    for job in jobs:
        for attempt in (1, 2, 3):  # a re-run, had there been one, completes too
            release(db, job, attempt)
    wait_until(
        lambda: all(history(db, job) for job in jobs),
        STEP_TIMEOUT,
        what="every job to complete",
        check=(a.check_alive, b.check_alive),
    )
    # (attempt, pid, finished) of every start, for each job that started more than once.
    assert started_twice(db, jobs) == {}, [history_errors(db, job) for job in jobs]
    for job in jobs:
        assert executions(db, job) == [(1, a.pid, True)]
        assert history(db, job) == [("completed", 1, {"pid": a.pid, "attempt": 1})]
        assert history_errors(db, job) == []


@pytest.mark.timeout(120)
def test_a_worker_cut_off_from_every_session_is_rescued_and_cannot_complete_late(
    app: skiplock.App, db: psycopg.Connection[Any], spawn: Spawn
) -> None:
    """A real network cut ends every session of A at once: A is taken for dead and its
    job runs again elsewhere, well before its 30 s lease ends; when A comes back, its late
    completion is refused."""
    b = spawn_leader(db, spawn)
    a = spawn()
    (job,) = enqueue(app, db, LEASED, hold=True)
    release(db, job, 2)
    wait_until(
        lambda: executions(db, job), STEP_TIMEOUT, what="the job to start", check=a.check_alive
    )

    a.stop()  # stopped, it cannot reconnect
    for pid in session_pids(db, a):
        db.execute("SELECT pg_terminate_backend(%s)", (pid,))
    c = spawn()
    wait_until(
        lambda: history(db, job),
        STEP_TIMEOUT,
        what="the job to run again",
        check=(b.check_alive, c.check_alive),
    )
    final = [("completed", 2, {"pid": c.pid, "attempt": 2})]
    assert history(db, job) == final
    assert history_errors(db, job) == [("WorkerLost", 1)]

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


# -- the statements, with sessions held by the test ----------------------------------------


def hold_sessions(stack: ExitStack, url: str, worker: uuid.UUID, count: int) -> list[Any]:
    """``count`` sessions of one worker, each holding its liveness lock as the worker's
    do. A lock timeout turns a lock that only one session may hold into an error."""
    sessions = []
    for _ in range(count):
        conn = stack.enter_context(
            psycopg.connect(url, autocommit=True, options="-c lock_timeout=2000")
        )
        conn.execute(render(maintenance.WORKER_LOCK, SCHEMA), {"id": worker})
        sessions.append(conn)
    return sessions


def register(conn: psycopg.Connection[Any], worker: uuid.UUID) -> None:
    conn.execute(
        render(maintenance.WORKER_REGISTER, SCHEMA),
        {
            "id": worker,
            "host": "test",
            "pid": 1,
            "queues": ["q"],
            "concurrency": 1,
            "holds_lock": True,
        },
    )


def workers_gone(conn: psycopg.Connection[Any], rescuer: uuid.UUID) -> list[uuid.UUID]:
    """Whom WORKERS_GONE would take for dead (rolled back: nothing is deleted)."""
    with conn.transaction(force_rollback=True):
        rows = conn.execute(
            render(maintenance.WORKERS_GONE, SCHEMA), {"worker_id": rescuer}
        ).fetchall()
    return [uuid.UUID(str(r[0])) for r in rows]


def elect(conn: psycopg.Connection[Any], worker: uuid.UUID) -> bool:
    row = conn.execute(
        render(maintenance.LEADER_ELECT, SCHEMA), {"worker_id": worker, "ttl": 3600}
    ).fetchone()
    return row is not None


def close_and_wait_gone(conn: psycopg.Connection[Any], db: psycopg.Connection[Any]) -> None:
    """Close a session and wait until its backend (and every lock it held) is gone."""
    pid = conn.info.backend_pid
    conn.close()
    wait_until(
        lambda: (
            db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() is None
        ),
        STEP_TIMEOUT,
        what=f"backend {pid} to exit",
    )


def test_a_worker_is_gone_only_once_its_last_session_is(
    app: skiplock.App, db: psycopg.Connection[Any], database_url: str
) -> None:
    worker, rescuer = uuid.uuid4(), uuid.uuid4()
    register(db, worker)
    with ExitStack() as stack:
        sessions = hold_sessions(stack, database_url, worker, 3)
        for session in sessions:
            assert workers_gone(db, rescuer) == []
            close_and_wait_gone(session, db)
        assert workers_gone(db, rescuer) == [worker]


@pytest.fixture
def plain_role(db: psycopg.Connection[Any], database_url: str) -> Iterator[str]:
    """A URL for a login role with no privilege at all, dropped at the end."""
    role = f"skiplock_liveness_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    params = {k: str(v) for k, v in conninfo_to_dict(database_url).items() if v is not None}
    params["user"] = role
    params.pop("password", None)
    try:
        yield make_conninfo("", **params)
    finally:
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_worker_running_as_another_role_is_judged_the_same(
    app: skiplock.App, db: psycopg.Connection[Any], plain_role: str
) -> None:
    """Workers may run as several roles: the lock needs no privilege, and a rescuer of
    another role sees it held (pg_stat_activity, which hides much of other roles'
    sessions, is not read)."""
    worker, rescuer = uuid.uuid4(), uuid.uuid4()
    register(db, worker)
    with ExitStack() as stack:
        (session,) = hold_sessions(stack, plain_role, worker, 1)
        assert workers_gone(db, rescuer) == []
        close_and_wait_gone(session, db)
    assert workers_gone(db, rescuer) == [worker]


def test_the_rescuer_never_takes_its_own_worker_for_gone(
    app: skiplock.App, db: psycopg.Connection[Any], database_url: str
) -> None:
    """The rescuer's own session holds its worker's lock, and a backend never conflicts
    with itself: without a guard, a leader whose other sessions were all cut at once would
    rescue its own running jobs."""
    worker = uuid.uuid4()
    register(db, worker)
    with ExitStack() as stack:
        (own,) = hold_sessions(stack, database_url, worker, 1)
        assert workers_gone(own, worker) == []


def test_a_leader_is_replaced_only_once_its_last_session_is_gone(
    app: skiplock.App, db: psycopg.Connection[Any], database_url: str
) -> None:
    old, new = uuid.uuid4(), uuid.uuid4()
    register(db, old)
    db.execute("DELETE FROM skiplock.leader")
    assert elect(db, old)
    with ExitStack() as stack:
        sessions = hold_sessions(stack, database_url, old, 2)
        for session in sessions:
            assert not elect(db, new)
            close_and_wait_gone(session, db)
        assert elect(db, new)
    assert leader(db) == new


# -- session names ---------------------------------------------------------------------------


def names_of(db: psycopg.Connection[Any], worker: skiplock.Worker) -> set[str]:
    rows = db.execute(
        "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"% {worker.id}",),
    ).fetchall()
    return {str(r[0]) for r in rows}


def test_every_session_of_a_worker_is_named_for_its_purpose_and_worker(
    app: skiplock.App, db: psycopg.Connection[Any], start_worker: StartWorker
) -> None:
    handle = start_worker(app)
    expected = {
        f"skiplock {purpose} {handle.worker.id}"
        for purpose in ("listener", "worker", "maintenance", "heartbeat")
    }
    wait_until(
        lambda: names_of(db, handle.worker) >= expected,
        STEP_TIMEOUT,
        what=f"sessions named {sorted(expected)}",
    )


def test_a_name_the_user_chose_wins(
    app: skiplock.App,
    db: psycopg.Connection[Any],
    start_worker: StartWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PGAPPNAME", "billing-worker")
    handle = start_worker(app)

    def named_by_the_user() -> int:
        row = db.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = 'billing-worker' AND pid <> pg_backend_pid()"
        ).fetchone()
        assert row is not None
        return int(row[0])

    wait_until(lambda: named_by_the_user() >= 4, STEP_TIMEOUT, what="the user's name")
    assert names_of(db, handle.worker) == set()
