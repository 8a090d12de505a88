"""Least privilege: a worker, an enqueuing app and an operator each as a login role that
owns nothing, with only what ``skiplock grant`` gives it.

The schema is migrated (and so owned) by the test's administrator. Roles are created per
test with random names and dropped afterwards (tests/roles.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import WorkerThread, wait_until
from roles import Roles, login_roles
from skiplock import cli, client, grants, history
from skiplock.grants import Use

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(120)]


@pytest.fixture
def roles(database_url: str) -> Iterator[Roles]:
    with login_roles(database_url) as created:
        yield created


@pytest.fixture
def schema(database_url: str, scratch_schema: str) -> str:
    skiplock.App(database_url, schema=scratch_schema).migrate()
    return scratch_schema


def run_cli(
    capsys: pytest.CaptureFixture[str], url: str, schema: str, *args: str
) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["--database-url", url, "--schema", schema, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def partitions(url: str, schema: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass",
            (f'"{schema}".job_history',),
        ).fetchall()
    return {str(r[0]) for r in rows}


def utc_today(url: str) -> date:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


# -- the statements: pure -------------------------------------------------------------


def test_each_use_gets_schema_usage_and_only_its_own_privileges() -> None:
    worker = grants.statements("my_schema", "app-worker", Use.WORKER)
    enqueue = grants.statements("my_schema", "app-worker", Use.ENQUEUE)
    admin = grants.statements("my_schema", "app-worker", Use.ADMIN)

    inserts = f"INSERT ({', '.join(grants.ENQUEUE_COLUMNS)})"
    for printed in (worker, enqueue, admin):
        assert printed[0] == 'GRANT USAGE ON SCHEMA "my_schema" TO "app-worker"'
        assert 'GRANT SELECT ON TABLE "my_schema"."schema_migrations" TO "app-worker"' in printed
        # The table-wide INSERT of earlier releases goes first; every use then inserts
        # the enqueue columns only, never an id (decision 022).
        assert printed[1] == 'REVOKE INSERT ON TABLE "my_schema"."jobs" FROM "app-worker"'
        assert not any(s.startswith("GRANT") and "INSERT," in s and '"jobs"' in s for s in printed)
    assert "id" not in grants.ENQUEUE_COLUMNS and "worker_id" not in grants.ENQUEUE_COLUMNS
    assert f'GRANT SELECT, {inserts} ON TABLE "my_schema"."jobs" TO "app-worker"' in enqueue
    assert not any("history_partition" in s for s in enqueue)
    assert not any("DELETE" in s and '"jobs"' in s for s in enqueue)
    for printed in (worker, admin):
        assert any("EXECUTE ON FUNCTION" in s and "history_partition_create" in s for s in printed)
        assert (
            f'GRANT SELECT, {inserts}, UPDATE, DELETE ON TABLE "my_schema"."jobs" TO "app-worker"'
            in printed
        )
    assert not any("ALL PRIVILEGES" in s or "TRUNCATE" in s for s in worker + enqueue + admin)


def test_the_upgrade_leaves_earlier_grants_with_the_enqueue_columns_only(
    database_url: str, scratch_schema: str, roles: Roles
) -> None:
    """Migration 0019 turns the table-wide INSERT on jobs that `skiplock grant` gave
    before into INSERT on the columns grants.ENQUEUE_COLUMNS lists, for every role."""
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate(target=18)
    role, url = roles.create("enqueue")
    with psycopg.connect(database_url, autocommit=True) as owner:
        for statement in grants.statements(scratch_schema, role, Use.ENQUEUE)[:1]:
            owner.execute(statement)
        owner.execute(
            sql.SQL("GRANT SELECT, INSERT ON TABLE {} TO {}").format(
                sql.Identifier(scratch_schema, "jobs"), sql.Identifier(role)
            )
        )
    app.migrate()

    with psycopg.connect(database_url, autocommit=True) as owner:
        columns = {
            str(r[0])
            for r in owner.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped AND has_column_privilege(%s, attrelid, attnum, 'INSERT')",
                (f'"{scratch_schema}".jobs', role),
            )
        }
    assert columns == set(grants.ENQUEUE_COLUMNS)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (task) VALUES ('t')").format(
                sql.Identifier(scratch_schema, "jobs")
            )
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                sql.SQL("INSERT INTO {} (id, task) VALUES (1000, 't')").format(
                    sql.Identifier(scratch_schema, "jobs")
                )
            )


def test_every_table_and_function_of_the_schema_has_a_decision(
    database_url: str, schema: str
) -> None:
    """A table or function added by a migration must be given to (or kept from) each use
    here, or a role that owns nothing fails on it in production."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        tables = {
            str(r[0])
            for r in conn.execute(
                "SELECT relname FROM pg_class WHERE relnamespace = %s::regnamespace "
                "AND relkind IN ('r', 'p') AND relname !~ '^job_history_p[0-9]{8}$'",
                (schema,),
            )
        }
        functions = {
            f"{r[0]}({r[1]})"
            for r in conn.execute(
                "SELECT proname, pg_get_function_identity_arguments(oid) FROM pg_proc "
                "WHERE pronamespace = %s::regnamespace AND prorettype <> 'trigger'::regtype",
                (schema,),
            )
        }

    assert tables == set(grants.TABLES)
    assert functions == {f"{name}({args})" for name, (args, _) in grants.FUNCTIONS.items()}


# -- the roles at work ------------------------------------------------------------------


def test_a_worker_an_enqueuer_and_an_admin_each_as_a_role_that_owns_nothing(
    database_url: str,
    schema: str,
    roles: Roles,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker_role, worker_url = roles.create("worker")
    enqueue_role, enqueue_url = roles.create("enqueue")
    admin_role, admin_url = roles.create("admin")
    for role, flag in (
        (worker_role, "--worker"),
        (enqueue_role, "--enqueue"),
        (admin_role, "--admin"),
    ):
        code, out, err = run_cli(capsys, database_url, schema, "grant", role, flag, "--apply")
        assert (code, err) == (0, "")
        assert f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"' in out
    # The leader of the worker must create tomorrow's partition again, as its own role.
    tomorrow = history.partition_name(utc_today(database_url) + timedelta(days=1))
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, tomorrow)))

    # The admin limits the queue first, so the worker's claims keep its rate window.
    code, out, err = run_cli(
        capsys, admin_url, schema, "queues", "limit", "default", "--rate", "1000/s"
    )
    assert (code, err) == (0, ""), err

    # The enqueuing app: enqueues, reads its jobs, and may not delete or run them.
    enqueuer = skiplock.App(enqueue_url, schema=schema)

    @enqueuer.task(name="double")
    def double_remote(n: int) -> int:
        return n * 2

    @enqueuer.task(name="fails", max_attempts=1)
    def fails_remote() -> None:
        raise AssertionError("runs on the worker")

    enqueuer.check_schema()
    with enqueuer.connect() as conn:
        ids = [int(double_remote.enqueue(conn, n=n)) for n in range(20)]
        ids += enqueuer.enqueue_many(conn, [double_remote.job(n=n) for n in range(20, 30)])
        ids += [
            int(double_remote.with_options(ordering_key="in-order").enqueue(conn, n=n))
            for n in range(30, 33)
        ]
        ids += [
            int(double_remote.with_options(rate_key="rated", rate_limit="100/s").enqueue(conn, n=n))
            for n in range(33, 35)
        ]
        ids.append(int(double_remote.with_options(unique_key="once").enqueue(conn, n=99)))
        doomed = int(fails_remote.enqueue(conn))
        later = int(double_remote.with_options(delay=3600).enqueue(conn, n=0))
    with psycopg.connect(enqueue_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, "jobs")))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                sql.SQL("UPDATE {} SET state = 'dead'").format(sql.Identifier(schema, "jobs"))
            )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                sql.SQL("SELECT {}(current_date + 30)").format(
                    sql.Identifier(schema, "history_partition_create")
                )
            )

    def state_of(job_id: int) -> str:
        with enqueuer.connect(autocommit=True) as conn:
            return client.get_job(conn, schema, job_id).state

    # The worker: drains every job and keeps history partitions, as its own role.
    worker_app = skiplock.App(worker_url, schema=schema)

    @worker_app.task(name="double")
    def double(n: int) -> int:
        return n * 2

    @worker_app.task(name="fails", max_attempts=1)
    def fails() -> None:
        raise ValueError("for the admin to retry")

    @worker_app.periodic("* * * * *", missed="latest", name="tick")
    def tick() -> None:
        pass

    handle = WorkerThread(
        skiplock.Worker(worker_app, poll_interval=0.05, rescue_interval=0.05, concurrency=4)
    ).start()
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:

            def finished() -> int:
                row = conn.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE id = ANY(%s)").format(
                        sql.Identifier(schema, "job_history")
                    ),
                    (ids,),
                ).fetchone()
                assert row is not None
                return int(row[0])

            wait_until(lambda: finished() == len(ids), 30, "the worker role to drain the jobs")
            wait_until(
                lambda: (
                    conn.execute(
                        sql.SQL("SELECT count(*) FROM {}").format(
                            sql.Identifier(schema, "periodic")
                        )
                    ).fetchone()
                    == (1,)
                ),
                30,
                "the worker role's leader to record the periodic task",
            )
            wait_until(
                lambda: tomorrow in partitions(database_url, schema),
                30,
                "the worker role's leader to create tomorrow's partition",
            )
            wait_until(lambda: state_of(doomed) == "dead", 30, "the failing job to die")
        assert enqueuer.result(ids[0], timeout=10) == 0
        assert enqueuer.result(ids[-1], timeout=10) == 198

        # The admin: the operator's commands, as a third role.
        code, out, err = run_cli(capsys, admin_url, schema, "status")
        assert (code, err) == (0, ""), err
        code, out, err = run_cli(capsys, admin_url, schema, "queues", "pause", "default")
        assert (code, err) == (0, ""), err
        code, out, err = run_cli(capsys, admin_url, schema, "jobs", "retry", str(doomed))
        assert (code, err) == (0, ""), err
        assert state_of(doomed) in ("available", "retryable", "scheduled")
        code, out, err = run_cli(capsys, admin_url, schema, "queues", "resume", "default")
        assert (code, err) == (0, ""), err
        wait_until(lambda: state_of(doomed) == "dead", 30, "the retried job to die again")
        code, out, err = run_cli(capsys, admin_url, schema, "prune", "--retention-days", "14")
        assert (code, err) == (0, ""), err
        code, out, err = run_cli(capsys, admin_url, schema, "jobs", "cancel", str(later), "--yes")
        assert (code, err) == (0, ""), err
        assert state_of(later) == "cancelled"
        code, out, err = run_cli(capsys, admin_url, schema, "doctor")
        assert code in (0, 1), err  # 1: a warning about the test's database, not a refusal
        assert "permission denied" not in out + err
        code, out, err = run_cli(capsys, admin_url, schema, "jobs", "delete", str(doomed), "--yes")
        assert (code, err) == (0, ""), err
    finally:
        handle.stop()

    def said(record: logging.LogRecord) -> str:
        raised = record.exc_info[1] if record.exc_info else None
        return f"{record.getMessage()} {raised or ''}"

    problems = [
        said(r)
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and r.name.startswith("skiplock")
        and ("permission denied" in said(r) or "must be owner" in said(r))
    ]
    assert problems == []
    with psycopg.connect(database_url, autocommit=True) as conn:
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class "
            "WHERE relnamespace = %s::regnamespace",
            (schema,),
        ).fetchall()
    assert (worker_role,) not in owners


def test_printing_grants_changes_nothing(
    database_url: str, schema: str, roles: Roles, capsys: pytest.CaptureFixture[str]
) -> None:
    role, url = roles.create("printed")

    code, out, err = run_cli(capsys, database_url, schema, "grant", role, "--enqueue")

    assert (code, err) == (0, "")
    assert out.splitlines() == [f"{s};" for s in grants.statements(schema, role, Use.ENQUEUE)]
    with (
        psycopg.connect(url, autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "jobs")))


def test_applying_grants_as_a_role_that_may_not_grant_says_so(
    database_url: str, schema: str, roles: Roles, capsys: pytest.CaptureFixture[str]
) -> None:
    _outsider, outsider_url = roles.create("outsider")
    other, _ = roles.create("other")

    code, _out, err = run_cli(capsys, outsider_url, schema, "grant", other, "--worker", "--apply")

    assert code == 2
    assert "owner" in err and "nothing was granted" in err


def test_applying_grants_with_privileges_but_no_grant_option_grants_nothing(
    database_url: str, schema: str, roles: Roles, capsys: pytest.CaptureFixture[str]
) -> None:
    """PostgreSQL only warns when a GRANT gives nothing; a role left half-granted would
    fail later, far from here, so the warning aborts the whole transaction."""
    operator, operator_url = roles.create("operator")
    other, other_url = roles.create("other")
    with psycopg.connect(database_url, autocommit=True) as owner:
        for statement in grants.statements(schema, operator, Use.ADMIN):
            owner.execute(statement)

    code, _out, err = run_cli(capsys, operator_url, schema, "grant", other, "--enqueue", "--apply")

    assert code == 2
    assert "no privileges were granted" in err and "nothing was granted" in err
    with psycopg.connect(other_url, autocommit=True) as conn:
        row = conn.execute("SELECT has_schema_privilege(%s, 'USAGE')", (schema,)).fetchone()
    assert row == (False,)


def test_applying_grants_to_a_role_that_does_not_exist_says_so(
    database_url: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = run_cli(
        capsys, database_url, schema, "grant", "skiplock_test_nobody", "--admin", "--apply"
    )

    assert code == 2
    assert "does not exist" in err and "nothing was granted" in err


def test_history_functions_are_not_for_everyone(
    database_url: str, schema: str, roles: Roles
) -> None:
    """EXECUTE is revoked from PUBLIC: a role with only USAGE on the schema cannot create
    or drop partitions through the owner's functions."""
    role, url = roles.create("usage")
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(schema), sql.Identifier(role)
            )
        )
    with psycopg.connect(url, autocommit=True) as conn:
        for function in ("history_partition_create", "history_partition_drop"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(
                    sql.SQL("SELECT {}(current_date)").format(sql.Identifier(schema, function))
                )


def test_the_drop_function_drops_only_daily_partitions_of_history(
    database_url: str, schema: str, roles: Roles
) -> None:
    role, url = roles.create("worker")
    day = date(2099, 1, 1)
    impostor = history.partition_name(day)
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute(sql.SQL("CREATE TABLE {} (x int)").format(sql.Identifier(schema, impostor)))
        for statement in grants.statements(schema, role, Use.WORKER):
            owner.execute(statement)

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("SELECT {}(%s)").format(sql.Identifier(schema, "history_partition_drop")),
            (day,),
        )
        report = history.maintain(
            conn,
            schema,
            retention=timedelta(days=1),
            now=datetime.combine(day + timedelta(days=10), time(12), tzinfo=UTC),
        )

    assert impostor not in report.dropped
    with psycopg.connect(database_url, autocommit=True) as owner:
        row = owner.execute("SELECT to_regclass(%s)", (f'"{schema}".{impostor}',)).fetchone()
    assert row is not None and row[0] is not None
