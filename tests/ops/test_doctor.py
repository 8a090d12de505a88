"""``skiplock doctor``: each problem it claims to find is staged for real and found, and a
healthy schema passes.

The local PostgreSQL 15 used in development runs with autovacuum off server-wide (on
purpose); the embedded server runs with it on. The server-wide finding is therefore
expected exactly when ``SHOW autovacuum`` says off.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import wait_until
from skiplock import doctor, history
from skiplock.doctor import Finding, Limits
from skiplock.migrate import available_migrations

from .conftest import Cli, Ops

pytestmark = pytest.mark.server_version

SERVER_AUTOVACUUM_OFF = "autovacuum is off for the whole server"


def findings(ops: Ops, limits: Limits | None = None, schema: str | None = None) -> list[Finding]:
    with ops.connect() as conn:
        return doctor.run(conn, schema or ops.schema, limits)


def of(found: list[Finding], check: str) -> list[Finding]:
    return [f for f in found if f.check == check]


def server_autovacuum_on(ops: Ops) -> bool:
    return bool(ops.scalar("SHOW autovacuum") == "on")


def eventually(
    ops: Ops, check: str, level: str, limits: Limits, matching: Callable[[Finding], bool]
) -> Finding:
    """Run the doctor until ``check`` reports ``level`` (staged conditions take a moment
    to show: transaction ages, statistics); return that finding."""
    seen: list[Finding] = []

    def found() -> bool:
        seen[:] = [f for f in of(findings(ops, limits), check) if f.level == level and matching(f)]
        return bool(seen)

    wait_until(found, timeout=15, what=f"doctor to report {level} on {check}")
    return seen[0]


# -- the all-clear -----------------------------------------------------------------------


def test_a_healthy_schema_has_no_failure(ops: Ops) -> None:
    ops.worker(last_seen=-5)
    found = findings(ops)

    checks = {f.check for f in found}
    assert checks >= {
        "migrations",
        "autovacuum",
        "oldest transaction",
        "notifications",
        "workers",
        "dead jobs",
        "indexes",
        "history partitions",
        "transactional jobs",
    }
    failures = [f.message for f in found if f.level == "fail"]
    if server_autovacuum_on(ops):
        assert failures == []
    else:
        assert failures == [SERVER_AUTOVACUUM_OFF]
    clear = ("migrations", "workers", "dead jobs", "indexes", "history partitions")
    for check in (*clear, "transactional jobs"):
        assert [f.level for f in of(found, check)] == ["ok"], of(found, check)


def test_the_server_wide_autovacuum_setting(ops: Ops) -> None:
    off = [f for f in of(findings(ops), "autovacuum") if f.message == SERVER_AUTOVACUUM_OFF]

    if server_autovacuum_on(ops):
        assert off == []
    else:
        assert [(f.level, f.fix) for f in off] == [
            (
                "fail",
                "set autovacuum = on in postgresql.conf: the queue tables churn constantly",
            )
        ]


# -- migrations ----------------------------------------------------------------------------


def test_pending_migrations_on_a_fresh_schema(ops: Ops, unmigrated_schema: str) -> None:
    found = findings(ops, schema=unmigrated_schema)

    names = ", ".join(f"{m.version:04d}_{m.name}" for m in available_migrations())
    # Nothing else is checked: there are no tables to check.
    assert found == [Finding("migrations", "fail", f"pending: {names}", "run `skiplock migrate`")]


def test_pending_migrations_on_a_schema_left_behind(ops: Ops, unmigrated_schema: str) -> None:
    skiplock.App(ops.url, schema=unmigrated_schema).migrate(target=3)

    (found,) = findings(ops, schema=unmigrated_schema)

    later = [f"{m.version:04d}_{m.name}" for m in available_migrations() if m.version > 3]
    assert (found.check, found.level) == ("migrations", "fail")
    assert found.message == "pending: " + ", ".join(later)


# -- autovacuum and dead tuples ------------------------------------------------------------


def disable_autovacuum(ops: Ops, value: str) -> None:
    with ops.connect() as conn:
        conn.execute(
            sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = {})").format(
                ops.table("jobs"), sql.SQL(value)
            )
        )


def test_autovacuum_disabled_on_the_jobs_table(ops: Ops) -> None:
    disable_autovacuum(ops, "false")

    (found,) = [f for f in of(findings(ops), "autovacuum") if "jobs" in f.message]

    assert found == Finding(
        "autovacuum",
        "fail",
        f"autovacuum is disabled on {ops.schema}.jobs",
        f"ALTER TABLE {ops.schema}.jobs RESET (autovacuum_enabled)",
    )
    with ops.connect() as conn:
        conn.execute(found.fix)  # the fix given is the fix
    assert [f for f in of(findings(ops), "autovacuum") if "jobs" in f.message] == []


def test_autovacuum_disabled_with_off(ops: Ops) -> None:
    disable_autovacuum(ops, "off")

    assert [f.level for f in of(findings(ops), "autovacuum") if "jobs" in f.message] == ["fail"]


def test_dead_tuples_on_a_queue_table(ops: Ops) -> None:
    # Fifty dead row versions: under the jobs table's autovacuum threshold (1000), over
    # this limit. Statistics reach the doctor when the writing session reports them.
    with ops.connect() as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (task) SELECT 'noop' FROM generate_series(1, 50)").format(
                ops.table("jobs")
            )
        )
        conn.execute(sql.SQL("DELETE FROM {}").format(ops.table("jobs")))

    found = eventually(
        ops,
        "dead tuples",
        "warn",
        Limits(dead_tuples=10),
        lambda f: f.message.startswith(f"{ops.schema}.jobs has "),
    )

    assert "dead row versions" in found.message
    assert "autovacuum" in found.fix


# -- what holds VACUUM back ----------------------------------------------------------------


def backend_pid(conn: psycopg.Connection[Any]) -> int:
    return int(conn.info.backend_pid)


def test_a_long_transaction_holding_a_snapshot(ops: Ops) -> None:
    """A repeatable-read transaction keeps its snapshot, and with it the xmin horizon.
    A moment's transaction id held while it starts makes its snapshot strictly older
    than any taken afterwards."""
    with ops.connect(autocommit=False) as writer, ops.connect(autocommit=False) as reader:
        writer.execute("SELECT txid_current()")
        reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT 1")
        writer.commit()

        found = eventually(
            ops, "oldest transaction", "warn", Limits(long_transaction_seconds=0.2), bool
        )

        assert "VACUUM cannot clean up behind it" in found.message
        assert found.fix.startswith("end it if it is stuck: SELECT pg_terminate_backend(")
        reader.rollback()


def test_a_long_transaction_idle_after_a_write(ops: Ops) -> None:
    with ops.connect(autocommit=False) as forgotten:
        forgotten.execute("SELECT txid_current()")
        pid = backend_pid(forgotten)
        wait_until(
            lambda: ops.scalar(
                "SELECT now() - xact_start > interval '0.3 seconds' "
                "FROM pg_stat_activity WHERE pid = %s",
                (pid,),
            ),
            what="the transaction to be older than the limit",
        )

        found = of(findings(ops, Limits(long_transaction_seconds=0.2)), "oldest transaction")

        assert [f.fix for f in found if f.level == "warn" and f"pid {pid} " in f.message] == [
            f"end it if it is stuck: SELECT pg_terminate_backend({pid})"
        ]
        forgotten.rollback()


def test_a_session_that_wrote_and_sits_idle_while_other_sessions_are_busy(ops: Ops) -> None:
    """A session that wrote a row and sits idle in its transaction holds an xid and no
    snapshot. Every snapshot taken while it is open starts at that xid, so busy sessions
    (a worker's claims, here two long statements) tie with it on the horizon: the doctor
    must still name the writer, and say what it holds."""
    with (
        ops.connect() as busy_1,
        ops.connect() as busy_2,
        ops.connect(autocommit=False) as writer,
    ):
        writer.execute(
            sql.SQL("INSERT INTO {} (task) VALUES ('written, never committed')").format(
                ops.table("jobs")
            )
        )
        pid = backend_pid(writer)
        busy = [
            threading.Thread(target=conn.execute, args=("SELECT pg_sleep(4)",), daemon=True)
            for conn in (busy_1, busy_2)
        ]
        wait_until(
            lambda: ops.scalar(
                "SELECT now() - xact_start > interval '1.5 seconds' "
                "FROM pg_stat_activity WHERE pid = %s",
                (pid,),
            ),
            what="the writer's transaction to be older than the limit",
        )
        for thread in busy:
            thread.start()
        wait_until(
            lambda: (
                ops.scalar(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE pid = ANY(%s) AND state = 'active' AND backend_xmin IS NOT NULL",
                    ([backend_pid(busy_1), backend_pid(busy_2)],),
                )
                == 2
            ),
            what="the busy sessions to hold snapshots",
        )

        found = of(findings(ops, Limits(long_transaction_seconds=1.0)), "oldest transaction")

        warned = [f for f in found if f.level == "warn" and f"pid {pid} " in f.message]
        assert [f.fix for f in warned] == [
            f"end it if it is stuck: SELECT pg_terminate_backend({pid})"
        ], found
        assert "idle in transaction" in warned[0].message
        assert "wrote" in warned[0].message and "no snapshot" in warned[0].message
        writer.rollback()
        for thread in busy:
            thread.join(10)


def test_a_long_transactional_job(ops: Ops) -> None:
    """A transactional-mode job holds its row with FOR UPDATE for as long as it runs."""
    job_id = ops.job()
    with ops.connect(autocommit=False) as running:
        running.execute(
            sql.SQL("SELECT id FROM {} WHERE id = %s FOR UPDATE").format(ops.table("jobs")),
            (job_id,),
        )
        pid = backend_pid(running)

        found = eventually(
            ops, "transactional jobs", "warn", Limits(transactional_job_seconds=0.2), bool
        )

        assert found.message.startswith("1 sessions have held job rows locked for over 0s")
        assert f"(longest: pid {pid}," in found.message
        assert "transactional=False" in found.fix
        running.rollback()
    assert [f.level for f in of(findings(ops), "transactional jobs")] == ["ok"]


def test_a_listener_stuck_in_a_transaction(ops: Ops) -> None:
    with ops.connect(autocommit=False) as listening:
        listening.execute("LISTEN ops_doctor_test")  # and never reads: idle in transaction

        found = eventually(ops, "notifications", "warn", Limits(), bool)

        assert "idle in a transaction" in found.message
        listening.rollback()


# -- workers, indexes, history ---------------------------------------------------------------


def test_stale_workers(ops: Ops) -> None:
    ops.worker(last_seen=-5)
    ops.worker(last_seen=-3600)
    ops.worker(last_seen=-7200, holds_lock=False)

    (found,) = of(findings(ops), "workers")

    assert found.level == "warn"
    assert found.message.startswith("2 registered workers of 3 not seen for 120s")
    assert [f.level for f in of(findings(ops, Limits(stale_worker_seconds=10_000)), "workers")] == [
        "ok"
    ]


def test_no_worker_registered_is_a_warning_not_an_all_clear(ops: Ops) -> None:
    (found,) = of(findings(ops), "workers")

    assert (found.level, found.message, found.fix) == (
        "warn",
        "no worker is registered: nothing runs this schema's jobs",
        "start one: skiplock worker MODULE:APP",
    )
    ops.worker(last_seen=-5)
    (found,) = of(findings(ops), "workers")
    assert (found.level, found.message) == ("ok", "1 registered worker, each seen in the last 120s")


def test_dead_jobs_are_named_per_queue_with_the_commands_that_handle_them(ops: Ops) -> None:
    assert [(f.level, f.message) for f in of(findings(ops), "dead jobs")] == [("ok", "none")]
    ops.job(state="dead", queue="mail", attempts=3, attempted_at=-60)
    ops.job(state="dead", queue="mail", attempts=3, attempted_at=-30)
    ops.job(state="dead", queue="billing", attempts=3, attempted_at=-7200)
    ops.job(state="retryable", queue="reports", attempts=1)

    found = of(findings(ops), "dead jobs")

    assert [f.level for f in found] == ["warn", "warn"]
    billing, mail = found
    assert billing.message == "queue billing has 1 dead job, the latest tried 7200s ago"
    assert mail.message == "queue mail has 2 dead jobs, the latest tried 30s ago"
    assert mail.fix == (
        "read them: skiplock jobs list --state dead --queue mail; then "
        "skiplock jobs retry --all --state dead --queue mail (or delete)"
    )


def test_an_invalid_index(ops: Ops) -> None:
    # A unique index built concurrently over duplicates fails and stays behind, invalid.
    ops.job(queue="same")
    ops.job(queue="same")
    with ops.connect() as conn, pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(
            sql.SQL("CREATE UNIQUE INDEX CONCURRENTLY ops_dup ON {} (queue)").format(
                ops.table("jobs")
            )
        )

    (found,) = of(findings(ops), "indexes")

    assert (found.level, found.message) == ("fail", "invalid indexes: ops_dup")
    assert "REINDEX INDEX CONCURRENTLY" in found.fix


def test_a_missing_partition_for_tomorrow(ops: Ops) -> None:
    tomorrow = history.partition_name(
        ops.scalar("SELECT (now() AT TIME ZONE 'UTC')::date + 1")  # the doctor's UTC day
    )
    with ops.connect() as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(ops.table(tomorrow)))

    (found,) = of(findings(ops), "history partitions")

    assert found.level == "fail"
    assert found.message.startswith(f"no partition for tomorrow ({tomorrow})")
    assert "skiplock prune" in found.fix
    with ops.connect() as conn:
        history.maintain(conn, ops.schema, retention=None)
    assert [f.level for f in of(findings(ops), "history partitions")] == ["ok"]


def test_rows_in_the_default_partition(ops: Ops) -> None:
    ops.history(finished_at=-20 * 86400.0, count=3)

    (found,) = of(findings(ops), "history partitions")

    assert found.level == "warn"
    assert found.message.startswith("3 finished jobs are in the DEFAULT partition")


# -- skiplock doctor -------------------------------------------------------------------------


def test_doctor_json(ops: Ops, run_cli: Cli) -> None:
    ops.worker(last_seen=-3600)

    result = run_cli("doctor", "--json")

    document = json.loads(result.out)
    assert all(set(f) == {"check", "level", "message", "fix"} for f in document)
    assert {f["level"] for f in document} <= {"ok", "warn", "fail"}
    assert [f["level"] for f in document if f["check"] == "workers"] == ["warn"]
    # Warnings alone exit 0; a failure exits 1.
    assert result.code == (1 if any(f["level"] == "fail" for f in document) else 0)
    assert result.code == (0 if server_autovacuum_on(ops) else 1)


def test_doctor_text_says_what_to_do(ops: Ops, run_cli: Cli) -> None:
    ops.worker(last_seen=-3600)

    lines = run_cli("doctor").out.splitlines()

    warning = lines.index(next(line for line in lines if line.startswith("[WARN] workers: ")))
    assert lines[warning + 1].strip().startswith("fix: their jobs are rescued")
    assert any(line.startswith("[ok  ] migrations: ") for line in lines)


def test_doctor_on_a_schema_never_migrated(ops: Ops, run_cli: Cli) -> None:
    ops.rows(f'DROP SCHEMA "{ops.schema}" CASCADE')

    result = run_cli("doctor")

    assert result.code == 1
    assert result.out.startswith("[FAIL] migrations: pending: 0001_")
    assert "fix: run `skiplock migrate`" in result.out
