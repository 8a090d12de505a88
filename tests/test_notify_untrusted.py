"""Notifications are hints from untrusted senders (issue 10, items 5 and 6).

NOTIFY needs no privilege: any role that can connect can send any payload on skiplock's
channels. A malformed payload is logged (one line per channel per interval) and ignored;
the listener, and with it the worker's liveness lock, survives whatever arrives, so no
running job of a healthy worker is rescued and run twice. A cancel request is acted on
only when the job's row confirms it, and a role with no rights on the schema can neither
cancel, nor change limits, nor move any job; a flood of admission requests is coalesced.

Each test sends its hostile payloads, then something whose effect only the listener can
explain (a wake-up while the poll interval is long, a real cancel while heartbeats are
rare): once that effect is seen, every earlier payload was handled, because a session's
notifications arrive in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import skiplock
from conftest import SCHEMA, StartWorker, WorkerThread, wait_until
from skiplock import client

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

JOBS = f"{SCHEMA}.jobs"
CONTROL = f"{SCHEMA}.control"
DONE = f"{SCHEMA}.done"

# Only a notification explains a prompt claim (the poll is 30 s) or a prompt cancel
# (heartbeats every 20 s); rescue by liveness is checked every 0.1 s, so a worker whose
# listener died would be found out, and its jobs rescued, at once.
LISTENING: dict[str, Any] = {
    "poll_interval": 30.0,
    "lease_seconds": 60.0,
    "rescue_interval": 0.1,
    "shutdown_timeout": 5.0,
    "concurrency": 4,
}

GARBAGE_WAKEUPS = [
    "",
    "default\t",
    "default\tx\t0",
    "default\t1.5\t0",
    "default\t²\t0",
    "default\t\u0661\u0662\t1733050000",
    "default\t99999999999999999999999\t0",
    "default\t0\tNaN",
    "default\t0\tinfinity",
    "default\t0\t1e999999",
    "default\t0\t" + "9" * 500,
    "\t\t",
    "q" * 7999,
    "default\t0\t" + "7" * 7980,
    "\u202egnp.exe\t\u200d\t\ufeff",
    "👩\u200d👩\u200d👧\t0\t0",
]
GARBAGE_CONTROL = [
    "",
    "cancel",
    "cancel\t",
    "cancel\t-1",
    "cancel\t0",
    "cancel\t99999999999999999999999",
    "cancel\t1\t2",
    "admit\t",
    "admit\t" + "k" * 300,
    "limits\tdefault",
    "stop",
    "x" * 7999,
    "\u202ecancel\t1",
]


# -- helpers ---------------------------------------------------------------------------


def notify(conn: psycopg.Connection[Any], channel: str, payload: str) -> None:
    """One notification in a transaction of its own (within one, equal ones fold)."""
    conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))


def liveness_lock_held(conn: psycopg.Connection[Any], worker: skiplock.Worker) -> bool:
    """Whether some session holds the worker's advisory liveness lock (pg_locks shows a
    bigint key as its high half in classid and its low half in objid)."""
    row = conn.execute(
        """
        SELECT EXISTS (
            SELECT 1
            FROM pg_locks AS l, (SELECT hashtextextended(%s::text, 0) AS k) AS h
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.database = (SELECT oid FROM pg_database
                                WHERE datname = current_database())
              AND l.classid::bigint = (h.k >> 32) & 4294967295
              AND l.objid::bigint = h.k & 4294967295)
        """,
        (str(worker.id),),
    ).fetchone()
    assert row is not None
    return bool(row[0])


def job_row(conn: psycopg.Connection[Any], job_id: int) -> tuple[str, int, list[str]]:
    """State, attempts and error types of a live or finished job."""
    job = client.get_job(conn, SCHEMA, job_id)
    return str(job.state), job.attempts, [e["type"] for e in job.errors]


class Runs:
    """What handlers did, by job: started, cancelled, finished; and a release for all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started: Counter[str] = Counter()
        self.cancelled: set[str] = set()
        self.finished: set[str] = set()
        self.release = threading.Event()

    def start(self, name: str) -> None:
        with self._lock:
            self.started[name] += 1

    def ran(self, name: str) -> bool:
        with self._lock:
            return self.started[name] > 0

    async def hold(self, name: str) -> str:
        """An async handler's body: runs until released or cancelled."""
        self.start(name)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            with self._lock:
                self.cancelled.add(name)
            raise
        with self._lock:
            self.finished.add(name)
        return name


def register(app: skiplock.App, runs: Runs) -> tuple[skiplock.Task[Any], skiplock.Task[str]]:
    @app.task(name="hold", max_attempts=5)
    async def hold(name: str) -> str:
        return await runs.hold(name)

    @app.task(name="quick", max_attempts=5)
    def quick(name: str) -> str:
        runs.start(name)
        return name

    return hold, quick


def enqueue(app: skiplock.App, call: Any, **args: Any) -> int:
    with psycopg.connect(app.database_url) as conn:
        job_id = int(call.enqueue(conn, **args))
    return job_id


def malformed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("skiplock") and "malformed" in r.getMessage()
    ]


@contextlib.contextmanager
def no_rights_role(database_url: str) -> Iterator[str]:
    """A URL for a new role with no rights on the schema (trust auth lets it connect);
    the role is dropped afterwards, also on failure. Used by the chaos scenario too."""
    role = f"hostile_{uuid.uuid4().hex[:12]}"
    params = {k: str(v) for k, v in conninfo_to_dict(database_url).items() if v is not None}
    params.pop("password", None)
    params["user"] = role
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield make_conninfo("", **params)
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.fixture
def hostile_url(database_url: str) -> Iterator[str]:
    with no_rights_role(database_url) as url:
        yield url


# -- item 5: malformed payloads --------------------------------------------------------


def test_a_cancel_with_a_superscript_digit_neither_kills_the_listener_nor_reruns_a_job(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    """'²'.isdigit() is True and int('²') raises: that once ended the listener task, its
    connection closed, the liveness lock went with it, and the leader rescued the running
    job of this healthy worker, which then ran twice."""
    runs = Runs()
    hold, quick = register(app, runs)
    handle = start_worker(app, **LISTENING)
    long_job = enqueue(app, hold, name="long")
    wait_until(lambda: runs.ran("long"), 15, "the long job to start")
    assert liveness_lock_held(autocommit, handle.worker)

    autocommit.execute("NOTIFY \"skiplock.control\", E'cancel\\t²'")
    after = enqueue(app, quick, name="after")  # its wake-up comes after the garbage

    wait_until(
        lambda: runs.ran("after") or job_row(autocommit, long_job)[0] != "running",
        15,
        "the wake-up sent after the garbage, or a rescue",
    )
    assert (liveness_lock_held(autocommit, handle.worker), job_row(autocommit, long_job)) == (
        True,
        ("running", 1, []),
    )
    assert runs.ran("after")
    # Alive all along: not restarted by the supervisor, not reconnected.
    assert handle.worker.service_restarts["listener"] == 0
    runs.release.set()
    assert skiplock.JobRef(long_job, app).result(timeout=15) == "long"
    assert job_row(autocommit, long_job) == ("completed", 1, [])
    assert skiplock.JobRef(after, app).result(timeout=15) == "after"
    assert runs.started == Counter({"long": 1, "after": 1})
    assert handle.alive


def test_garbage_on_every_channel_is_logged_once_per_channel_and_ignored(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = Runs()
    hold, quick = register(app, runs)
    handle = start_worker(app, **LISTENING)
    long_job = enqueue(app, hold, name="long")
    wait_until(lambda: runs.ran("long"), 15, "the long job to start")
    caplog.set_level(logging.WARNING, logger="skiplock")

    for payload in GARBAGE_WAKEUPS:
        notify(autocommit, JOBS, payload)
    for payload in [*GARBAGE_CONTROL, f"cancel\t{long_job}0", f"cancel\t{long_job}\t"]:
        notify(autocommit, CONTROL, payload)
    after = enqueue(app, quick, name="after")

    assert skiplock.JobRef(after, app).result(timeout=15) == "after"
    assert liveness_lock_held(autocommit, handle.worker)
    assert handle.worker.service_restarts["listener"] == 0
    assert job_row(autocommit, long_job) == ("running", 1, [])
    # One line per channel: the rest of each burst is held back and counted.
    lines = malformed_lines(caplog)
    assert len(lines) == 2, lines
    assert any(JOBS in line for line in lines) and any(CONTROL in line for line in lines)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    runs.release.set()
    assert skiplock.JobRef(long_job, app).result(timeout=15) == "long"
    assert runs.started == Counter({"long": 1, "after": 1})


# -- item 6: requests are confirmed by the database ------------------------------------


def test_a_spoofed_cancel_is_not_acted_on_and_a_real_one_is(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    runs = Runs()
    hold, _ = register(app, runs)
    start_worker(app, **LISTENING)
    spoofed = enqueue(app, hold, name="spoofed")
    real = enqueue(app, hold, name="real")
    wait_until(lambda: runs.ran("spoofed") and runs.ran("real"), 15, "both jobs to start")

    # What JOB_CANCEL_RUNNING would announce, but without the request on the row.
    notify(autocommit, CONTROL, f"cancel\t{spoofed}")
    assert client.cancel_jobs(autocommit, SCHEMA, [real]) == 1

    wait_until(lambda: job_row(autocommit, real)[0] == "cancelled", 15, "the real cancel")
    assert runs.cancelled == {"real"}
    assert job_row(autocommit, spoofed) == ("running", 1, [])
    runs.release.set()
    assert skiplock.JobRef(spoofed, app).result(timeout=15) == "spoofed"
    assert runs.cancelled == {"real"}
    assert runs.started == Counter({"spoofed": 1, "real": 1})


def test_a_role_with_no_rights_can_neither_cancel_nor_change_limits_nor_move_jobs(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    hostile_url: str,
) -> None:
    runs = Runs()
    hold, _ = register(app, runs)
    limited = hold.with_options(queue="limited")
    keyed = hold.with_options(ordering_key="account:1")
    client.set_queue_limits(autocommit, SCHEMA, "limited", concurrency=1)
    handle = start_worker(app, queues=["default", "limited"], **LISTENING)
    running = enqueue(app, hold, name="running")
    limited_first = enqueue(app, limited, name="limited-1")
    limited_second = enqueue(app, limited, name="limited-2")
    keyed_first = enqueue(app, keyed, name="keyed-1")
    keyed_second = enqueue(app, keyed, name="keyed-2")
    wait_until(
        lambda: all(runs.ran(n) for n in ("running", "limited-1", "keyed-1")),
        15,
        "the first jobs to start",
    )
    ids = [running, limited_first, limited_second, keyed_first, keyed_second]
    limits_before = client.list_queues(autocommit, SCHEMA)

    with psycopg.connect(hostile_url, autocommit=True) as hostile:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            hostile.execute(f"SELECT 1 FROM {SCHEMA}.jobs LIMIT 1")
        for job_id in ids:
            notify(hostile, CONTROL, f"cancel\t{job_id}")
        for payload in ("admit", "admit\taccount:1", "admit\tnobody", "limits"):
            notify(hostile, CONTROL, payload)
        for queue in ("default", "limited"):
            # Positions far behind and far ahead, and a bare queue name.
            for payload in (queue, f"{queue}\t-32768\t0", f"{queue}\t32767\t253402300000"):
                notify(hostile, JOBS, payload)
        notify(hostile, DONE, "")
        notify(hostile, DONE, f"{running}")
        for payload in GARBAGE_CONTROL:
            notify(hostile, CONTROL, payload)
    # A real request after all of them: once it took effect, they were all handled.
    assert client.cancel_jobs(autocommit, SCHEMA, [running]) == 1
    wait_until(lambda: job_row(autocommit, running)[0] == "cancelled", 15, "the real cancel")

    assert runs.cancelled == {"running"}
    assert liveness_lock_held(autocommit, handle.worker)
    assert handle.worker.service_restarts["listener"] == 0
    assert client.list_queues(autocommit, SCHEMA) == limits_before
    assert [job_row(autocommit, job_id) for job_id in ids[1:]] == [
        ("running", 1, []),
        ("available", 0, []),  # the queue's limit of one still holds
        ("running", 1, []),
        ("blocked", 0, []),  # so does the key's
    ]
    runs.release.set()
    for job_id in ids[1:]:
        assert skiplock.JobRef(job_id, app).result(timeout=20) is not None
    assert [job_row(autocommit, job_id) for job_id in ids[1:]] == [("completed", 1, [])] * 4
    assert runs.started == Counter(
        {"running": 1, "limited-1": 1, "limited-2": 1, "keyed-1": 1, "keyed-2": 1}
    )
    assert runs.cancelled == {"running"}


def test_a_flood_of_admission_requests_is_coalesced(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    hostile_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every 'admit' asks for a full pass over every waiting key. A flood of them, one
    every 20 ms for 2 s, must not run one pass per message."""
    from skiplock.worker.leader import KeyAdmission as Admission  # noqa: PLC0415 - spied on

    passes: list[float] = []
    original = Admission.admit_pass

    async def counted(self: Admission, asked: list[str] | None) -> Any:
        if asked is None:
            passes.append(time.monotonic())
        return await original(self, asked)

    monkeypatch.setattr(Admission, "admit_pass", counted)
    runs = Runs()
    hold, _ = register(app, runs)
    keyed = hold.with_options(ordering_key="account:1")
    handle: WorkerThread = start_worker(app, **{**LISTENING, "admit_interval": 60.0})
    first = enqueue(app, keyed, name="keyed-1")
    enqueue(app, keyed, name="keyed-2")  # waits behind the first: passes find work
    wait_until(lambda: runs.ran("keyed-1"), 15, "the first keyed job to start")

    messages = 100
    with psycopg.connect(hostile_url, autocommit=True) as hostile:
        flood_started = time.monotonic()
        for _ in range(messages):
            notify(hostile, CONTROL, "admit")
            time.sleep(0.02)  # the flood's pace, not a wait for an outcome
    assert client.cancel_jobs(autocommit, SCHEMA, [first]) == 1
    wait_until(lambda: job_row(autocommit, first)[0] == "cancelled", 15, "the real cancel")

    during = [at for at in passes if at >= flood_started]
    # Coalesced, not ignored: the requests still brought passes.
    assert 1 <= len(during) <= messages // 10, f"{len(during)} full passes for {messages} requests"
    assert handle.alive
    runs.release.set()
