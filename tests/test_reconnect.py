"""A worker the database refused for a while (a network outage, a restart, a failover that
took its time) works again within seconds of being let back in, however long it was out:
its connection pools try again at a bounded pace, not with a back-off that keeps growing
(psycopg_pool's own doubles without a cap until its reconnect_timeout, five minutes)."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import StartWorker, wait_until
from roles import login_roles

# Refused for longer than psycopg_pool's back-off steps add up to (1 + 2 + 4 + 8 + 16 s):
# its tries would come at about 31 and 63 s, so a worker let in at 60 s would wait for the
# second (a shorter outage can end just before one of them and hide the growth).
REFUSED_SECONDS = 60.0
# Back to work within this long of being let in (the pools try every few seconds).
BACK_WITHIN = 8.0


def completed(conn: psycopg.Connection[Any], schema: str, job_id: int) -> bool:
    query = sql.SQL("SELECT 1 FROM {} WHERE id = %s").format(sql.Identifier(schema, "job_history"))
    return conn.execute(query, (job_id,)).fetchone() is not None


# The pools' pace is the client's, whatever the server: a minute long, run once.
@pytest.mark.second_server
@pytest.mark.timeout(REFUSED_SECONDS + 90)
def test_a_worker_refused_for_a_while_works_again_soon_after_it_is_let_in(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    with login_roles(app.database_url) as roles:
        role, url = roles.create("refused")
        ident = sql.Identifier(role)
        autocommit.execute(sql.SQL("ALTER ROLE {} SUPERUSER").format(ident))
        worker_app = skiplock.App(url, schema=app.schema)

        @worker_app.task(name="ping")
        def ping() -> None:
            pass

        handle = start_worker(worker_app, poll_interval=0.1)
        with autocommit.transaction():
            first = ping.enqueue(autocommit)
        wait_until(lambda: completed(autocommit, app.schema, first), 30.0, "the first job")

        # Refused: no new session may start, and its sessions are ended.
        autocommit.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(ident))
        autocommit.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        time.sleep(REFUSED_SECONDS)  # the outage's length: the test's schedule
        autocommit.execute(sql.SQL("ALTER ROLE {} LOGIN").format(ident))
        with autocommit.transaction():
            second = ping.enqueue(autocommit)
        try:
            wait_until(
                lambda: completed(autocommit, app.schema, second),
                BACK_WITHIN,
                "the worker to work again once let in",
            )
        finally:
            autocommit.execute(sql.SQL("ALTER ROLE {} LOGIN").format(ident))
            handle.stop()  # while its role still exists
