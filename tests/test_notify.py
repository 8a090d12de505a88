"""NOTIFY is a wake-up sent by a statement-level insert trigger: one per queue per statement,
on a channel named after the schema, only when the inserting transaction commits, and only
while a worker waits on the queue (its sentinel keys: decision 023)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import skiplock
from conftest import CHANNEL, JobFactory, Listener, StartWorker, wait_until
from skiplock import client

pytestmark = pytest.mark.server_version


def test_the_insert_trigger_fires_once_per_statement_after_insert(
    autocommit: psycopg.Connection[Any],
) -> None:
    rows = autocommit.execute(
        "SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t "
        "WHERE t.tgrelid = 'skiplock.jobs'::regclass AND NOT t.tgisinternal"
        "  AND pg_get_triggerdef(t.oid) LIKE '%AFTER INSERT%'"
    ).fetchall()

    assert len(rows) == 1
    definition = rows[0][1]
    assert "FOR EACH STATEMENT" in definition


def test_the_key_triggers_fire_only_for_keyed_rows(autocommit: psycopg.Connection[Any]) -> None:
    """The row trigger of 0008 must cost plain jobs nothing but its WHEN test; the DELETE
    trigger of 0015 (decision 017) fires once per statement, not per row, and its
    function returns at once when no deleted row had a key (measured: a few µs)."""
    rows = autocommit.execute(
        "SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t "
        "WHERE t.tgrelid = 'skiplock.jobs'::regclass AND NOT t.tgisinternal"
        "  AND pg_get_triggerdef(t.oid) NOT LIKE '%AFTER INSERT%'"
    ).fetchall()

    triggers = dict(rows)
    assert set(triggers) == {
        "jobs_key_moved",
        "jobs_keys_left",
        "jobs_step_dead",
        "jobs_step_retried",
        "jobs_steps_left",
    }
    assert "FOR EACH ROW WHEN (((old.ordering_key IS NOT NULL) AND" in triggers["jobs_key_moved"]
    assert "AFTER DELETE" in triggers["jobs_keys_left"]
    assert "FOR EACH STATEMENT" in triggers["jobs_keys_left"]
    # The workflows' (0022, decision 024) likewise: a row trigger's WHEN is all a job
    # without a workflow pays, and the DELETE trigger fires once per statement.
    for name in ("jobs_step_dead", "jobs_step_retried"):
        assert "FOR EACH ROW WHEN (((new.workflow_id IS NOT NULL) AND" in triggers[name]
    assert "AFTER DELETE" in triggers["jobs_steps_left"]
    assert "FOR EACH STATEMENT" in triggers["jobs_steps_left"]


def test_a_multi_row_insert_notifies_each_queue_once(
    app: skiplock.App, autocommit: psycopg.Connection[Any], listener: Listener
) -> None:
    listener.wait_on("a", "b", "c")
    autocommit.execute(
        "INSERT INTO skiplock.jobs (task, queue) "
        "SELECT 't', (ARRAY['a', 'b', 'c'])[1 + i % 3] FROM generate_series(1, 300) AS i"
    )

    assert sorted(listener.collect()) == ["a", "b", "c"]


def test_separate_statements_notify_separately(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    listener.wait_on("a", "b")
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO skiplock.jobs (task, queue) VALUES ('t', 'a')")
        conn.execute("INSERT INTO skiplock.jobs (task, queue) VALUES ('t', 'b')")

    assert sorted(listener.collect()) == ["a", "b"]


def test_copy_into_the_jobs_table_notifies_each_queue_once(
    app: skiplock.App, database_url: str, listener: Listener
) -> None:
    listener.wait_on("even", "odd")
    copy_in = "COPY skiplock.jobs (task, queue, args) FROM STDIN"
    with psycopg.connect(database_url) as conn, conn.cursor().copy(copy_in) as copy:
        for n in range(100):
            copy.write_row(("bulk", "even" if n % 2 == 0 else "odd", f'{{"n": {n}}}'))

    assert sorted(listener.collect()) == ["even", "odd"]
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM skiplock.jobs").fetchone() == (100,)


def test_each_schema_notifies_on_its_own_channel(
    database_url: str, scratch_schema: str, listener: Listener
) -> None:
    other_app = skiplock.App(database_url, schema=scratch_schema)
    other_app.migrate()
    task = other_app.task(name="t")(lambda: None)
    other = Listener(database_url, f"{scratch_schema}.jobs")
    other.wait_on("default", schema=scratch_schema)
    listener.wait_on("default")
    try:
        with psycopg.connect(database_url) as conn:
            task.enqueue(conn)

        assert other.collect() == ["default"]
        assert listener.channel == CHANNEL
        assert listener.collect() == []
    finally:
        other.close()


def test_a_manual_retry_notifies_the_jobs_queue(
    app: skiplock.App, make_job: JobFactory, listener: Listener, database_url: str
) -> None:
    listener.wait_on("emails")
    job_id = make_job(queue="emails", state="dead", attempts=3)
    assert listener.collect() == []  # a dead job is nothing to claim

    with psycopg.connect(database_url) as conn:
        client.retry_job(conn, app.schema, job_id)

    assert listener.collect() == ["emails"]


def test_a_worker_whose_connections_are_all_killed_is_woken_again(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    done: list[int] = []
    lock = threading.Lock()

    @app.task(name="note")
    def note(n: int) -> None:
        with lock:
            done.append(n)

    # A long poll interval: only a notification (or the sweep after the listener
    # reconnects) can explain a prompt pickup.
    start_worker(app, poll_interval=30.0)
    killed = autocommit.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()
    assert killed is not None
    assert killed[0] > 0

    def insert_and_wait(n: int) -> None:
        autocommit.execute(
            "INSERT INTO skiplock.jobs (task, args) VALUES ('note', %s)", (Jsonb({"n": n}),)
        )
        wait_until(lambda: n in done, 15.0, f"job {n} to run after the connections died")

    insert_and_wait(1)
    insert_and_wait(2)

    assert done == [1, 2]
