"""An enqueue-only role enqueues and does nothing else (decision 022), tested with three
roles: the schema's owner (who migrated it), a worker role and an enqueue role, each as
``skiplock grant`` sets it up.

- It may not write a job's id: the application's own enqueues can never collide with an
  id taken by hand, whichever path they take (single, unique, windowed, COPY).
- It may not write what only a worker writes (worker_id, lease, attempts, errors, ...):
  no row it writes is running, and no error record of its making reaches a page.
- Rows in a state no worker created, whoever wrote them (running under no registered
  worker, a lease longer than its worker's own), are rescued by the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import skiplock
from conftest import WorkerThread
from roles import Roles, login_roles
from skiplock import client, grants
from skiplock.config import notify_channel
from skiplock.contrib import sqlalchemy as contrib
from skiplock.grants import Use
from skiplock.sql import maintenance, render
from skiplock.tasks import JobSpec

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(120)]


@pytest.fixture
def roles(database_url: str) -> Iterator[Roles]:
    with login_roles(database_url) as created:
        yield created


@pytest.fixture
def schema(database_url: str, scratch_schema: str) -> str:
    skiplock.App(database_url, schema=scratch_schema).migrate()
    return scratch_schema


def granted(database_url: str, schema: str, roles: Roles, use: Use) -> str:
    """A new login role with what ``skiplock grant --<use>`` gives; its URL."""
    role, url = roles.create(use.value)
    with psycopg.connect(database_url) as owner:
        grants.apply(owner, schema, role, use)
    return url


SCHEMA_OF: dict[str, str] = {}


@pytest.fixture
def jobs(schema: str) -> str:
    """The test's schema, for run() to name its jobs table."""
    SCHEMA_OF["jobs"] = schema
    return schema


def run(conn: psycopg.Connection[Any], statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """``statement`` with {jobs} as the test schema's jobs table (literal braces doubled)."""
    table = sql.Identifier(SCHEMA_OF["jobs"], "jobs")
    cur = conn.execute(sql.SQL(statement).format(jobs=table), params or None)
    return cur.fetchall() if cur.description else []


def define(app: skiplock.App) -> Any:
    """The task both sides know, as the enqueuing app's or the worker's."""

    @app.task(name="echo")
    def echo(n: int) -> int:
        return n

    return echo


# -- ids: the enqueue role takes none by hand -----------------------------------------------


def test_ids_taken_by_hand_never_make_the_applications_enqueues_collide(
    database_url: str, schema: str, roles: Roles, jobs: str
) -> None:
    """The enqueue role writes rows with the ids the sequence will give next; the
    application's enqueue (the same role, or any other) must still succeed."""
    enqueue_url = granted(database_url, schema, roles, Use.ENQUEUE)
    app = skiplock.App(enqueue_url, schema=schema)
    echo = define(app)

    with psycopg.connect(enqueue_url, autocommit=True) as hand:
        (next_id,) = run(
            hand, "SELECT nextval(pg_get_serial_sequence(%s, 'id'))", f"{schema}.jobs"
        )[0]
        for statement in (
            "INSERT INTO {jobs} (id, task) SELECT i, 'echo' "
            "FROM generate_series(%s::bigint + 1, %s::bigint + 100) AS i",
            "INSERT INTO {jobs} (id, task) OVERRIDING SYSTEM VALUE "
            "SELECT i, 'echo' FROM generate_series(%s::bigint + 101, %s::bigint + 200) AS i",
        ):
            with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                run(hand, statement, next_id, next_id)
        # Nor can it move the sequence back to hand out ids that are taken (USAGE gives
        # nextval and currval only).
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            run(hand, "SELECT setval(pg_get_serial_sequence(%s, 'id'), 1)", f"{schema}.jobs")

    with app.connect() as conn:
        ids = [int(echo.enqueue(conn, n=1))]
        ids += app.enqueue_many(conn, [echo.job(n=n) for n in range(5)])
        ids.append(int(echo.with_options(unique_key="k").enqueue(conn, n=2)))
        ids.append(int(echo.with_options(unique_key="w", unique_window=60).enqueue(conn, n=3)))
    assert len(set(ids)) == len(ids) == 8
    with psycopg.connect(database_url, autocommit=True) as owner:
        assert run(owner, "SELECT count(*) FROM {jobs} WHERE task = 'echo'") == [(8,)]


# -- what a worker writes: never the enqueue role ----------------------------------------------


@pytest.mark.parametrize(
    "columns, values",
    [
        # A made-up worker and a lease that never ends: no rescue would ever take it.
        (
            "state, worker_id, lease_expires_at",
            "'running', gen_random_uuid(), 'infinity'",
        ),
        # Error records that are not what a worker writes (the pages read them).
        ("state, errors", '\'dead\', \'[1, "x", {"no": "type"}]\''),
        ("attempts", "5"),
        ("retry_at", "'infinity'"),
        ("progress", "'{\"a\": 1}'"),
        ("claimed_ahead", "true"),
        ("cancel_requested_at", "now()"),
        ("started_at, worker_ids", "now(), ARRAY[gen_random_uuid()]"),
        ("created_at", "'-infinity'"),
        ("attempted_at", "now()"),
    ],
)
def test_the_enqueue_role_may_not_write_what_only_workers_write(
    database_url: str,
    schema: str,
    roles: Roles,
    jobs: str,
    columns: str,
    values: str,
) -> None:
    enqueue_url = granted(database_url, schema, roles, Use.ENQUEUE)
    with psycopg.connect(enqueue_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            literal = values.replace("{", "{{").replace("}", "}}")
            run(conn, f"INSERT INTO {{jobs}} (task, {columns}) VALUES ('echo', {literal})")
        copy_in = sql.SQL("COPY {} (task, {}) FROM STDIN").format(
            sql.Identifier(schema, "jobs"), sql.SQL(columns)
        )
        with (
            pytest.raises(psycopg.errors.InsufficientPrivilege),
            conn.cursor().copy(copy_in) as copy,
        ):
            copy.write("echo\t" + "\t".join("x" for _ in columns.split(",")) + "\n")
    with psycopg.connect(database_url, autocommit=True) as owner:
        assert run(owner, "SELECT count(*) FROM {jobs}") == [(0,)]


def test_a_running_row_with_a_made_up_worker_does_not_stall_a_limited_queue(
    database_url: str, schema: str, roles: Roles, jobs: str
) -> None:
    """Written by a role that may (the owner here: the enqueue role no longer can), a
    running row under a worker that never registered, with a lease that never ends, held
    the only slot of a queue limited to one running job: the queue stalled for good. The
    leader rescues it like a dead worker's job."""
    worker_url = granted(database_url, schema, roles, Use.WORKER)
    enqueue_url = granted(database_url, schema, roles, Use.ENQUEUE)
    with psycopg.connect(database_url, autocommit=True) as owner:
        client.set_queue_limits(owner, schema, "default", concurrency=1)
        (stray,) = run(
            owner,
            "INSERT INTO {jobs} (task, args, state, attempts, worker_id, lease_expires_at) "
            "VALUES ('echo', '{{\"n\": 21}}', 'running', 1, gen_random_uuid(), 'infinity') "
            "RETURNING id",
        )[0]
    enqueuer = skiplock.App(enqueue_url, schema=schema)
    worker_app = skiplock.App(worker_url, schema=schema)
    define(worker_app)
    with enqueuer.connect() as conn:
        job = int(define(enqueuer).enqueue(conn, n=1))
    handle = WorkerThread(
        skiplock.Worker(worker_app, poll_interval=0.05, rescue_interval=0.05, lease_seconds=2)
    ).start()
    try:
        assert enqueuer.result(job, timeout=20) == 1
        assert enqueuer.result(stray, timeout=20) == 21
    finally:
        handle.stop()
    with psycopg.connect(database_url, autocommit=True) as owner:
        (errors,) = owner.execute(
            sql.SQL("SELECT errors FROM {} WHERE id = %s").format(
                sql.Identifier(schema, "job_history")
            ),
            (stray,),
        ).fetchone() or (None,)
    assert [e["type"] for e in errors] == ["WorkerUnknown"]


def test_a_live_worker_that_lost_its_registration_keeps_the_jobs_it_just_claimed(
    database_url: str, schema: str, jobs: str
) -> None:
    """After a server restart the leader may drop the registration of a worker still
    reconnecting (no liveness lock yet); that worker goes on claiming, under leases of an
    ordinary length, and registers again at its next beat. Its jobs are not strays: taken
    as such they ran twice (tests/chaos' restart scenario). Only a lease further ahead than
    any registered worker writes, on a claim older than such a lease, marks one."""
    live = uuid.uuid4()
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute(
            render(maintenance.WORKER_REGISTER, schema),
            {
                "id": live,
                "host": "h",
                "pid": 1,
                "queues": ["default"],
                "concurrency": 1,
                "holds_lock": True,
            },
        )
        owner.execute(
            sql.SQL("UPDATE {} SET lease_seconds = 60").format(sql.Identifier(schema, "workers"))
        )
        (claimed,) = run(
            owner,
            "INSERT INTO {jobs} (task, args, state, attempts, worker_id, attempted_at,"
            " lease_expires_at) VALUES ('echo', '{{}}', 'running', 1, gen_random_uuid(), now(),"
            " now() + interval '60 seconds') RETURNING id",
        )[0]
        (stray,) = run(
            owner,
            "INSERT INTO {jobs} (task, args, state, attempts, worker_id, lease_expires_at) "
            "VALUES ('echo', '{{}}', 'running', 1, gen_random_uuid(), 'infinity') RETURNING id",
        )[0]
        moved = owner.execute(
            render(maintenance.JOB_RESCUE_STRAY, schema),
            {"worker_id": live, "channel": notify_channel(schema)},
        ).fetchall()
        states = dict(run(owner, "SELECT id, state FROM {jobs} ORDER BY id"))

    assert len(moved) == 1
    assert states == {claimed: "running", stray: "available"}


def test_a_lease_longer_than_its_workers_own_is_rescued(
    database_url: str, schema: str, roles: Roles, jobs: str
) -> None:
    """A live, registered worker writes leases of its own length (2 s here); a row under
    its id whose lease ends in a year was written by someone else, and the worker will
    never run it (it is not among its jobs): rescued, not left to block the queue."""
    worker_url = granted(database_url, schema, roles, Use.WORKER)
    worker_app = skiplock.App(worker_url, schema=schema)
    define(worker_app)
    worker = skiplock.Worker(worker_app, poll_interval=0.05, rescue_interval=0.05, lease_seconds=2)
    handle = WorkerThread(worker).start()
    try:
        with psycopg.connect(database_url, autocommit=True) as owner:
            (stray,) = run(
                owner,
                "INSERT INTO {jobs} (task, args, state, attempts, worker_id, lease_expires_at) "
                "VALUES ('echo', '{{\"n\": 4}}', 'running', 1, %s, now() + interval '1 year') "
                "RETURNING id",
                worker.id,
            )[0]
        assert worker_app.result(stray, timeout=20) == 4
    finally:
        handle.stop()


# -- every enqueue path, as the enqueue role ---------------------------------------------------


def test_every_enqueue_path_works_for_the_enqueue_role(
    database_url: str, schema: str, roles: Roles, jobs: str
) -> None:
    enqueue_url = granted(database_url, schema, roles, Use.ENQUEUE)
    worker_url = granted(database_url, schema, roles, Use.WORKER)
    enqueuer = skiplock.App(enqueue_url, schema=schema)
    worker_app = skiplock.App(worker_url, schema=schema)
    define(worker_app)
    echo_task = define(enqueuer)
    expected: dict[int, int] = {}

    def expect(job_id: int, n: int) -> None:
        expected[int(job_id)] = n

    with enqueuer.connect() as conn:
        expect(echo_task.enqueue(conn, n=1), 1)
        bulk = enqueuer.enqueue_many(conn, [echo_task.job(n=n) for n in range(10, 20)])
        for n, job_id in zip(range(10, 20), bulk, strict=True):
            expect(job_id, n)
        keyed = [echo_task.with_options(ordering_key=f"k{n % 2}").job(n=n) for n in range(20, 24)]
        for n, job_id in zip(range(20, 24), enqueuer.enqueue_many(conn, keyed), strict=True):
            expect(job_id, n)
        expect(echo_task.with_options(unique_key="a").enqueue(conn, n=30), 30)
        assert int(echo_task.with_options(unique_key="a").enqueue(conn, n=31)) in expected
        expect(
            echo_task.with_options(unique_key="q", unique_scope="queued").enqueue(conn, n=32), 32
        )
        window = echo_task.with_options(unique_key="w", unique_window=3600)
        first = int(window.enqueue(conn, n=33))
        expect(first, 33)
        assert int(window.enqueue(conn, n=34)) == first
        # Replacing a waiting holder's arguments (job_replace_waiting, SECURITY DEFINER).
        replacing = echo_task.with_options(unique_key="r", replace="args")
        holder = int(replacing.enqueue(conn, n=35))
        assert int(replacing.enqueue(conn, n=36)) == holder
        expect(holder, 36)
        # Tags, in the meta column the role may write, alone and in bulk.
        expect(echo_task.with_options(tags=["role"]).enqueue(conn, n=37), 37)
        tagged = [echo_task.with_options(tags=["role"]).job(n=n) for n in (38, 39)]
        for n, job_id in zip((38, 39), enqueuer.enqueue_many(conn, tagged), strict=True):
            expect(job_id, n)
        unique_many = [echo_task.with_options(unique_key=f"m{n}").job(n=n) for n in range(40, 43)]
        for n, job_id in zip(range(40, 43), enqueuer.enqueue_many(conn, unique_many), strict=True):
            expect(job_id, n)
        windows = [
            echo_task.with_options(unique_key=f"wm{n}", unique_window=3600).job(n=n)
            for n in range(50, 52)
        ]
        for n, job_id in zip(range(50, 52), enqueuer.enqueue_many(conn, windows), strict=True):
            expect(job_id, n)
        # Plain SQL, as the README shows it.
        for statement, n in [
            ("INSERT INTO {jobs} (task, args) VALUES ('echo', '{{\"n\": 60}}') RETURNING id", 60),
            (
                "INSERT INTO {jobs} (task, queue, max_attempts, args) "
                "VALUES ('echo', 'default', 5, '{{\"n\": 61}}') RETURNING id",
                61,
            ),
            (
                "INSERT INTO {jobs} (task, args, run_at, state) "
                "VALUES ('echo', '{{\"n\": 62}}', now(), 'scheduled') RETURNING id",
                62,
            ),
            (
                "INSERT INTO {jobs} (task, args, ordering_key, key_limit, state) "
                "VALUES ('echo', '{{\"n\": 63}}', 'sql', 1, 'blocked') RETURNING id",
                63,
            ),
        ]:
            expect(run(conn, statement)[0][0], n)

    async def enqueue_async() -> None:
        async with await psycopg.AsyncConnection.connect(enqueue_url) as aconn:
            expect(await echo_task.enqueue_async(aconn, n=70), 70)
            ids = await enqueuer.enqueue_many_async(aconn, [echo_task.job(n=n) for n in (71, 72)])
            expect(ids[0], 71)
            expect(ids[1], 72)
            window_async = echo_task.with_options(unique_key="wa", unique_window=3600)
            expect(await window_async.enqueue_async(aconn, n=73), 73)

    asyncio.run(enqueue_async())

    handle = WorkerThread(
        skiplock.Worker(worker_app, poll_interval=0.05, rescue_interval=0.05, concurrency=4)
    ).start()
    try:
        for job_id, n in expected.items():
            assert enqueuer.result(job_id, timeout=30) == n, job_id
    finally:
        handle.stop()


def test_bulk_ids_come_back_in_order_while_other_sessions_take_ids(
    database_url: str, schema: str, roles: Roles, jobs: str
) -> None:
    """A bulk enqueue's ids come from the sequence as its rows are copied in, while other
    sessions take ids too: each id returned is its own job's."""
    enqueue_url = granted(database_url, schema, roles, Use.ENQUEUE)
    app = skiplock.App(enqueue_url, schema=schema)
    stop = threading.Event()

    def interleave() -> None:
        with psycopg.connect(enqueue_url, autocommit=True) as other:
            while not stop.is_set():
                run(other, "INSERT INTO {jobs} (task) SELECT 'other' FROM generate_series(1, 3)")

    others = [threading.Thread(target=interleave) for _ in range(2)]
    for thread in others:
        thread.start()
    try:
        for _ in range(3):
            specs = [
                JobSpec(
                    task="echo",
                    args_json=json.dumps({"n": n}),
                    queue="bulk",
                    priority=0,
                    max_attempts=3,
                )
                for n in range(3000)
            ]
            with app.connect() as conn:
                ids = app.enqueue_many(conn, specs)
            with psycopg.connect(database_url, autocommit=True) as owner:
                rows = dict(
                    run(owner, "SELECT id, (args ->> 'n')::int FROM {jobs} WHERE id = ANY(%s)", ids)
                )
            assert [rows[i] for i in ids] == list(range(3000))
            assert len(set(ids)) == 3000
    finally:
        stop.set()
        for thread in others:
            thread.join(10)


def test_sqlalchemy_sessions_enqueue_as_the_enqueue_role(
    database_url: str, schema: str, roles: Roles, jobs: str
) -> None:
    """skiplock.contrib.sqlalchemy enqueues through the same statements, in the session's
    transaction: single and bulk, sync and async, as the enqueue role."""
    enqueue_url = granted(database_url, schema, roles, Use.ENQUEUE)
    app = skiplock.App(enqueue_url, schema=schema)
    echo = define(app)
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(enqueue_url))
    with Session(engine) as session, session.begin():
        ids = [int(contrib.enqueue(session, echo, n=1))]
        ids += contrib.enqueue_many(session, [echo.job(n=n) for n in (2, 3)], app=app)

    async def enqueue_async() -> list[int]:
        async def connect() -> psycopg.AsyncConnection[Any]:
            return await psycopg.AsyncConnection.connect(enqueue_url)

        aengine = create_async_engine("postgresql+psycopg://", async_creator=connect)
        try:
            async with AsyncSession(aengine) as session, session.begin():
                made = [int(await contrib.enqueue_async(session, echo, n=4))]
                made += await contrib.enqueue_many_async(session, [echo.job(n=5)], app=app)
                return made
        finally:
            await aengine.dispose()

    ids += asyncio.run(enqueue_async())
    engine.dispose()
    with psycopg.connect(database_url, autocommit=True) as owner:
        rows = dict(
            run(owner, "SELECT id, (args ->> 'n')::int FROM {jobs} WHERE id = ANY(%s)", ids)
        )
    assert [rows[i] for i in ids] == [1, 2, 3, 4, 5]
