"""Migrations: every path to head gives the same schema, old rows stay workable, a missing
migration is named with the command that fixes it, and concurrent migrators are safe.

Each test works in its own schema (``mig_<random>``), dropped afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import JobFactory, StartWorker, WorkerThread, wait_until
from roles import login_roles, url_as
from skiplock import cli, client, grants
from skiplock import migrate as skiplock_migrate
from skiplock.migrate import Migration, available_migrations, head_version

pytestmark = pytest.mark.server_version

VERSIONS = [m.version for m in available_migrations()]
OLD_VERSIONS = VERSIONS[:-1]

# Everything a migration can create, read from the catalogs. Column positions are ranks,
# not attnum, so a column dropped on the way does not count as a difference.
CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, c.reloptions
        FROM pg_class c
        WHERE c.relnamespace = %(schema)s::regnamespace
        ORDER BY c.relname""",
    "columns": """
        SELECT c.relname, rank() OVER (PARTITION BY c.relname ORDER BY a.attnum), a.attname,
               format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated,
               a.attcollation::regcollation::text
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = %(schema)s::regnamespace
          AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "indexes": """
        SELECT c.relname, pg_get_indexdef(i.indexrelid)
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relnamespace = %(schema)s::regnamespace
        ORDER BY 1""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, contype, pg_get_constraintdef(oid)
        FROM pg_constraint
        WHERE connamespace = %(schema)s::regnamespace
        ORDER BY 1, 2""",
    "triggers": """
        SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = %(schema)s::regnamespace AND NOT t.tgisinternal
        ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p
        WHERE p.pronamespace = %(schema)s::regnamespace
        ORDER BY 1, 2""",
    "types": """
        SELECT t.typname, t.typtype,
               (SELECT array_agg(e.enumlabel ORDER BY e.enumsortorder)
                FROM pg_enum e WHERE e.enumtypid = t.oid)
        FROM pg_type t
        WHERE t.typnamespace = %(schema)s::regnamespace AND t.typtype IN ('e', 'd', 'r')
        ORDER BY 1""",
    "sequences": """
        SELECT c.relname, s.seqtypid::regtype::text, s.seqstart, s.seqincrement, s.seqmax,
               s.seqmin, s.seqcache, s.seqcycle
        FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
        WHERE c.relnamespace = %(schema)s::regnamespace
        ORDER BY 1""",
}


def catalog_dump(url: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """The schema's definition with its own name replaced, so two schemas compare."""

    def neutral(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(schema, "<schema>")
        if isinstance(value, list):
            return [neutral(item) for item in value]
        return value

    with psycopg.connect(url, autocommit=True) as conn:
        dump = {
            kind: [
                tuple(neutral(v) for v in row) for row in conn.execute(query, {"schema": schema})
            ]
            for kind, query in CATALOG.items()
        }
        dump["ledger"] = conn.execute(
            sql.SQL("SELECT version, name FROM {}.schema_migrations ORDER BY version").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    return dump


def ledger(url: str, schema: str) -> list[int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            int(row[0])
            for row in conn.execute(
                sql.SQL("SELECT version FROM {}.schema_migrations ORDER BY version").format(
                    sql.Identifier(schema)
                )
            )
        ]


def test_migrations_are_numbered_from_one_without_gaps() -> None:
    versions = [m.version for m in available_migrations()]

    assert versions == list(range(1, len(versions) + 1))
    assert head_version() == versions[-1]


@pytest.mark.parametrize("first", OLD_VERSIONS)
def test_step_by_step_equals_all_at_once(
    database_url: str, scratch_schemas: Callable[[], str], first: int
) -> None:
    stepwise, at_once = scratch_schemas(), scratch_schemas()

    applied_first = skiplock.App(database_url, schema=stepwise).migrate(target=first)
    applied_rest = skiplock.App(database_url, schema=stepwise).migrate()
    applied_all = skiplock.App(database_url, schema=at_once).migrate()

    assert [m.version for m in applied_first] == VERSIONS[:first]
    assert [m.version for m in applied_rest] == VERSIONS[first:]
    assert [m.version for m in applied_all] == VERSIONS
    stepwise_dump = catalog_dump(database_url, stepwise)
    assert stepwise_dump["relations"]  # the dump sees the tables at all
    assert stepwise_dump == catalog_dump(database_url, at_once)


def test_migrating_an_up_to_date_schema_does_nothing(
    database_url: str, scratch_schema: str
) -> None:
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate()
    before = catalog_dump(database_url, scratch_schema)

    assert app.migrate() == []
    assert catalog_dump(database_url, scratch_schema) == before


@pytest.mark.parametrize("old", OLD_VERSIONS)
def test_rows_written_at_an_old_version_are_workable_at_head(
    database_url: str, scratch_schema: str, start_worker: StartWorker, old: int
) -> None:
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate(target=old)
    jobs = sql.Identifier(scratch_schema, "jobs")
    with psycopg.connect(database_url) as conn:
        ready = conn.execute(
            sql.SQL(
                """INSERT INTO {} (task, args) VALUES ('legacy', '{{"n": 1}}') RETURNING id"""
            ).format(jobs)
        ).fetchone()
        dead = conn.execute(
            sql.SQL(
                "INSERT INTO {} (task, args, state, attempts, max_attempts) "
                """VALUES ('legacy', '{{"n": 2}}', 'dead', 1, 1) RETURNING id"""
            ).format(jobs)
        ).fetchone()
    assert ready is not None
    assert dead is not None

    app.migrate()
    ran: list[int] = []

    @app.task(name="legacy")
    def legacy(n: int) -> None:
        ran.append(n)

    start_worker(app, poll_interval=0.05)
    with psycopg.connect(database_url) as conn:
        client.retry_job(conn, scratch_schema, dead[0])

    with psycopg.connect(database_url, autocommit=True) as conn:

        def finished() -> list[tuple[Any, ...]]:
            return conn.execute(
                sql.SQL("SELECT id, state FROM {} ORDER BY id").format(
                    sql.Identifier(scratch_schema, "job_history")
                )
            ).fetchall()

        wait_until(lambda: len(finished()) == 2, 15.0, "both old jobs to complete")
        assert finished() == [(ready[0], "completed"), (dead[0], "completed")]
    assert sorted(ran) == [1, 2]


def test_an_unmigrated_schema_is_refused_naming_the_command(
    database_url: str, scratch_schema: str
) -> None:
    app = skiplock.App(database_url, schema=scratch_schema)

    with pytest.raises(skiplock.SchemaNotReadyError, match="skiplock migrate") as caught:
        app.check_schema()

    assert scratch_schema in str(caught.value)
    assert "0001_" in str(caught.value)


@pytest.mark.skipif(not OLD_VERSIONS, reason="only one migration exists")
def test_a_schema_behind_head_is_refused_naming_what_is_missing(
    database_url: str, scratch_schema: str
) -> None:
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate(target=OLD_VERSIONS[-1])

    with pytest.raises(skiplock.SchemaNotReadyError, match="skiplock migrate") as caught:
        app.check_schema()

    head = available_migrations()[-1]
    assert f"{head.version:04d}_{head.name}" in str(caught.value)
    assert "0001_" not in str(caught.value)
    app.migrate()
    app.check_schema()


def test_a_worker_does_not_start_on_an_unmigrated_schema(
    database_url: str, scratch_schema: str, start_worker: StartWorker
) -> None:
    app = skiplock.App(database_url, schema=scratch_schema)

    with pytest.raises(skiplock.SchemaNotReadyError, match="skiplock migrate"):
        start_worker(app, poll_interval=0.05)


def test_concurrent_migrations_both_succeed_and_apply_each_version_once(
    database_url: str, scratch_schema: str
) -> None:
    barrier = threading.Barrier(2)
    results: list[list[Migration]] = []
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            barrier.wait(10)
            results.append(skiplock.App(database_url, schema=scratch_schema).migrate())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert errors == []
    assert len(results) == 2
    assert sorted(m.version for applied in results for m in applied) == VERSIONS
    assert ledger(database_url, scratch_schema) == VERSIONS


def test_a_failing_migration_leaves_the_schema_as_the_one_before_left_it(
    database_url: str, scratch_schemas: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each migration commits on its own (so none holds its locks while the next waits
    for others): a failing one rolls back alone, and the ones before it stay applied."""
    schema, reference = scratch_schemas(), scratch_schemas()
    app = skiplock.App(database_url, schema=schema)
    app.migrate(target=1)
    skiplock.App(database_url, schema=reference).migrate()
    broken = Migration(
        head_version() + 1, "broken", "CREATE TABLE half_done (x int);\nSELECT 1 / 0;\n"
    )
    ship(monkeypatch, broken)

    with pytest.raises(psycopg.errors.DivisionByZero):
        app.migrate()

    assert catalog_dump(database_url, schema) == catalog_dump(database_url, reference)


# -- migrations while workers run ----------------------------------------------------------


def extra(sql_text: str, name: str = "extra", offset: int = 1) -> Migration:
    """A migration after the shipped ones (as the next release would bring)."""
    return Migration(head_version() + offset, name, sql_text)


def ship(monkeypatch: pytest.MonkeyPatch, *more: Migration) -> None:
    shipped = available_migrations()
    monkeypatch.setattr("skiplock.migrate.available_migrations", lambda: [*shipped, *more])


def index_state(url: str, schema: str, index: str) -> tuple[bool, bool] | None:
    """(valid, ready) of an index, None when there is none of that name."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT indisvalid, indisready FROM pg_index WHERE indexrelid = to_regclass(%s)",
            (f'"{schema}".{index}',),
        ).fetchone()
    return None if row is None else (bool(row[0]), bool(row[1]))


def test_a_migration_gives_up_on_a_held_lock_names_itself_and_applies_nothing(
    database_url: str, scratch_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    skiplock.App(database_url, schema=scratch_schema).migrate()
    before = catalog_dump(database_url, scratch_schema)
    note = extra("ALTER TABLE jobs ADD COLUMN extra_note text;\n", "note")
    ship(monkeypatch, note)
    waits: list[float] = []

    with psycopg.connect(database_url) as holder:
        # A reader's open transaction: its ACCESS SHARE lock blocks ALTER TABLE.
        holder.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(scratch_schema, "jobs"))
        )
        with psycopg.connect(database_url, autocommit=True) as conn:
            with pytest.raises(skiplock_migrate.MigrationLockTimeoutError) as caught:
                skiplock_migrate.migrate(
                    conn, scratch_schema, lock_timeout=0.05, attempts=3, sleep=waits.append
                )
            # The migrator's session is left as it was found.
            settings = conn.execute(
                "SELECT current_setting('lock_timeout'), current_setting('search_path')"
            ).fetchone()
        holder.rollback()

    message = str(caught.value)
    assert note.label in message
    assert "lock_timeout" in message and "again" in message
    assert len(waits) == 2  # three attempts, with a back-off between them
    assert settings == ("0", '"$user", public')
    assert catalog_dump(database_url, scratch_schema) == before


def test_a_migration_retries_after_a_lock_timeout_and_then_applies(
    database_url: str, scratch_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    skiplock.App(database_url, schema=scratch_schema).migrate()
    note = extra("ALTER TABLE jobs ADD COLUMN extra_note text;\n", "note")
    ship(monkeypatch, note)
    holder = psycopg.connect(database_url)
    holder.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(scratch_schema, "jobs"))
    )

    def release(_: float) -> None:  # the long transaction ends during the back-off
        holder.rollback()

    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            applied = skiplock_migrate.migrate(
                conn, scratch_schema, lock_timeout=0.05, attempts=3, sleep=release
            )
    finally:
        holder.close()

    assert [m.name for m in applied] == ["note"]
    assert ledger(database_url, scratch_schema)[-1] == note.version


def test_the_lock_timeout_comes_from_the_environment_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(skiplock_migrate.LOCK_TIMEOUT_ENV, raising=False)
    assert skiplock_migrate.lock_timeout_seconds() == skiplock_migrate.DEFAULT_LOCK_TIMEOUT
    monkeypatch.setenv(skiplock_migrate.LOCK_TIMEOUT_ENV, "2.5")
    assert skiplock_migrate.lock_timeout_seconds() == 2.5
    assert skiplock_migrate.lock_timeout_seconds(0.2) == 0.2
    monkeypatch.setenv(skiplock_migrate.LOCK_TIMEOUT_ENV, "soon")
    with pytest.raises(skiplock.ConfigurationError, match="SKIPLOCK_MIGRATE_LOCK_TIMEOUT"):
        skiplock_migrate.lock_timeout_seconds()


def test_no_transaction_migrations_are_split_into_checked_statements() -> None:
    migration = extra(
        "-- skiplock: no-transaction\n"
        "-- Build it without blocking writes.\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_by_task\n"
        "    ON jobs (task);  -- the task filter\n"
        "\n"
        "DROP INDEX CONCURRENTLY IF EXISTS jobs_old;\n"
    )

    assert not migration.transactional
    assert extra("CREATE INDEX x ON jobs (task);").transactional
    assert skiplock_migrate.no_transaction_statements(migration) == [
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_by_task\n    ON jobs (task)",
        "DROP INDEX CONCURRENTLY IF EXISTS jobs_old",
    ]
    for bad, why in (
        ("CREATE INDEX CONCURRENTLY jobs_by_task ON jobs (task);", "IF NOT EXISTS"),
        ("CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;", "dollar"),
        ("CREATE INDEX CONCURRENTLY IF NOT EXISTS i ON jobs (task)", "end with ';'"),
    ):
        with pytest.raises(skiplock.ConfigurationError, match=why):
            skiplock_migrate.no_transaction_statements(
                extra(f"-- skiplock: no-transaction\n{bad}\n")
            )


def test_shipped_no_transaction_migrations_are_well_formed() -> None:
    for migration in available_migrations():
        if not migration.transactional:
            assert skiplock_migrate.no_transaction_statements(migration)


def test_a_no_transaction_migration_builds_its_index_concurrently(
    database_url: str, scratch_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate()
    ship(
        monkeypatch,
        extra(
            "-- skiplock: no-transaction\n"
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_by_task ON jobs (task);\n",
            "by_task",
        ),
    )

    assert [m.name for m in app.migrate()] == ["by_task"]
    assert index_state(database_url, scratch_schema, "jobs_by_task") == (True, True)
    assert app.migrate() == []


def test_an_index_left_invalid_by_an_interrupted_build_is_built_again(
    database_url: str, scratch_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A concurrent build that fails leaves an INVALID index; IF NOT EXISTS alone would
    keep it for good, so the next run drops it and builds it again."""
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate()
    ship(
        monkeypatch,
        extra(
            "-- skiplock: no-transaction\n"
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS jobs_one_per_task ON jobs (task);\n",
            "one_per_task",
        ),
    )
    make_job = JobFactory(database_url, scratch_schema)
    duplicates = [make_job(task="same"), make_job(task="same")]

    with pytest.raises(psycopg.errors.UniqueViolation):
        app.migrate()
    assert index_state(database_url, scratch_schema, "jobs_one_per_task") == (False, False)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE id = %s").format(sql.Identifier(scratch_schema, "jobs")),
            (duplicates[1],),
        )
    assert [m.name for m in app.migrate()] == ["one_per_task"]

    assert index_state(database_url, scratch_schema, "jobs_one_per_task") == (True, True)


# The last version released before the migrations that issue 10 brings; the test below
# applies every migration since, as an upgrade would while its workers keep draining.
LAST_RELEASED_VERSION = 10
MILLION = 1_000_000


@pytest.mark.timeout(600)
def test_the_newest_migrations_apply_to_a_million_jobs_while_a_worker_drains(
    database_url: str,
    scratch_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No claim, completion or enqueue is blocked by the migration for more than a second:
    the worker's role and the enqueuer run with lock_timeout 1s, so any wait longer than
    that fails their statement, which the worker logs ("lock timeout") and the enqueuer
    records. The newest migrations, plus a concurrent index build over the million rows
    (the kind of step a next release brings; built in a transaction, it takes seconds
    here and blocks every write meanwhile), apply meanwhile.

    An enqueue that arrives while a migration waits for its lock queues behind it, so its
    wait is the migration's lock_timeout plus what the migration does under the lock. The
    default 0.5 s would leave half a second for the holding, which a loaded CI machine
    stretches 0011's 0.2 s past (seen once in CI); 0.2 s leaves 0.8 s, still well under the
    1.4 s of the index built in a transaction."""
    monkeypatch.setenv(skiplock_migrate.LOCK_TIMEOUT_ENV, "0.2")
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate(target=LAST_RELEASED_VERSION)
    shipped = available_migrations()
    next_release = extra(
        "-- skiplock: no-transaction\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_by_digest ON jobs (md5(args::text));\n",
        "by_digest",
    )
    jobs = sql.Identifier(scratch_schema, "jobs")
    with psycopg.connect(database_url, autocommit=True) as conn:
        # A backlog in a queue this worker does not serve: every lock on jobs and every
        # index build sees the million rows.
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (queue, task, args) "
                "SELECT 'backlog', 'later', jsonb_build_object('n', n) "
                "FROM generate_series(1, %s) AS n"
            ).format(jobs),
            (MILLION,),
        )
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(jobs))

    with login_roles(database_url) as roles:
        role, worker_url = roles.create("worker", ("lock_timeout", "1s"))
        with psycopg.connect(database_url, autocommit=True) as owner:
            for statement in grants.statements(scratch_schema, role, grants.Use.WORKER):
                # The history functions come with 0012, the workflow tables with 0022,
                # the durable steps' with 0028, signals with 0029.
                later = ('"workflow', '"job_steps"', '"signals"')
                if "FUNCTION" not in statement and not any(t in statement for t in later):
                    # jobs.meta: 0017, jobs.workflow_id: 0022
                    owner.execute(statement.replace(", meta, workflow_id)", ")"))
        enqueue_url = url_as(database_url, role)
        worker_app = skiplock.App(worker_url, schema=scratch_schema)

        @worker_app.task(name="drain")
        def drain(n: int) -> int:
            return n

        enqueued: list[int] = []
        refused: list[BaseException] = []
        migrated = threading.Event()

        def feed() -> None:
            """Enqueue a job every few milliseconds until the migration is done."""
            with psycopg.connect(enqueue_url, autocommit=True) as conn:
                n = 0
                while not migrated.is_set() or n < 50:
                    try:
                        enqueued.append(int(drain.enqueue(conn, n=n)))
                    except psycopg.Error as exc:
                        refused.append(exc)
                    n += 1
                    time.sleep(0.005)

        def finished() -> int:
            with psycopg.connect(database_url, autocommit=True) as conn:
                row = conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(
                        sql.Identifier(scratch_schema, "job_history")
                    )
                ).fetchone()
            assert row is not None
            return int(row[0])

        handle = WorkerThread(
            skiplock.Worker(worker_app, poll_interval=0.05, rescue_interval=0.05, concurrency=4)
        )
        feeder = threading.Thread(target=feed, name="feeder", daemon=True)
        # The worker starts as one of the release before would, seeing the schema at its
        # head; this code stands in for it (claims and completions touch the same tables).
        monkeypatch.setattr(
            "skiplock.migrate.available_migrations",
            lambda: [m for m in shipped if m.version <= LAST_RELEASED_VERSION],
        )
        handle.start()
        monkeypatch.setattr(
            "skiplock.migrate.available_migrations", lambda: [*shipped, next_release]
        )
        try:
            feeder.start()
            wait_until(lambda: len(enqueued) >= 20, 30, "the feeder to start")
            finished_before, enqueued_before = finished(), len(enqueued)
            applied = app.migrate()
            finished_during, enqueued_during = finished(), len(enqueued)
            migrated.set()
            # The migration overlapped real work: jobs were enqueued and finished meanwhile.
            assert enqueued_during > enqueued_before
            assert finished_during > finished_before
            feeder.join(60)
            assert not feeder.is_alive()
            with psycopg.connect(database_url, autocommit=True) as conn:

                def done() -> int:
                    row = conn.execute(
                        sql.SQL("SELECT count(*) FROM {} WHERE id = ANY(%s)").format(
                            sql.Identifier(scratch_schema, "job_history")
                        ),
                        (enqueued,),
                    ).fetchone()
                    assert row is not None
                    return int(row[0])

                wait_until(lambda: done() == len(enqueued), 60, "every fed job to complete")
        finally:
            migrated.set()
            handle.stop()

    assert [m.version for m in applied] == [
        *(v for v in VERSIONS if v > LAST_RELEASED_VERSION),
        next_release.version,
    ]
    assert index_state(database_url, scratch_schema, "jobs_by_digest") == (True, True)
    assert refused == []
    blocked = [
        r.getMessage()
        for r in caplog.records
        if "lock timeout" in r.getMessage() and r.name != "skiplock.history"
    ]
    assert blocked == []


def test_printed_sql_of_a_no_transaction_migration_sets_the_search_path_for_the_session(
    database_url: str,
    scratch_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`migrate --sql` is for running by hand: SET LOCAL outside a transaction would leave
    the statements to run in whatever schema comes first."""
    skiplock.App(database_url, schema=scratch_schema).migrate()
    by_task = extra(
        "-- skiplock: no-transaction\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_by_task ON jobs (task);\n",
        "by_task",
    )
    ship(monkeypatch, by_task)
    capsys.readouterr()

    code = cli.main(
        ["--database-url", database_url, "--schema", scratch_schema, "migrate", "--sql"]
    )

    assert code == 0
    assert capsys.readouterr().out.startswith(
        f"-- {by_task.label}\nSET search_path TO {scratch_schema};\n-- skiplock: no-transaction\n"
    )


def test_queued_keys_held_twice_before_0011_keep_one_holder_and_park_the_others(
    database_url: str, scratch_schema: str
) -> None:
    """Before 0011 a waiting keyed job did not hold its 'queued' unique key, so duplicates
    could be accepted; the migration keeps the admitted (else the oldest) holder and ends
    the others dead, with the reason, without the key."""
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate(target=10)
    insert = sql.SQL(
        "INSERT INTO {} (task, args, state, ordering_key, unique_queued_key) "
        "VALUES ('report', '{{}}', %s, %s, %s) RETURNING id"
    ).format(sql.Identifier(scratch_schema, "jobs"))
    rows = [
        ("blocked", "a", "u"),  # the oldest of three waiting under u
        ("blocked", "b", "u"),
        ("available", "c", "u"),  # admitted: it keeps u
        ("blocked", "a", "v"),  # oldest of two waiting under v: keeps it
        ("blocked", "b", "v"),
        ("blocked", "c", "w"),  # alone: untouched
    ]
    with psycopg.connect(database_url) as conn:
        ids = [int(conn.execute(insert, row).fetchone()[0]) for row in rows]  # type: ignore[index]

    app.migrate()

    with psycopg.connect(database_url) as conn:
        found = {
            int(job_id): (state, key, [e["message"] for e in errors])
            for job_id, state, key, errors in conn.execute(
                sql.SQL("SELECT id, state, unique_queued_key, errors FROM {}").format(
                    sql.Identifier(scratch_schema, "jobs")
                )
            )
        }
    assert [found[job_id][:2] for job_id in ids] == [
        ("dead", None),
        ("dead", None),
        ("available", "u"),
        ("blocked", "v"),
        ("dead", None),
        ("blocked", "w"),
    ]
    assert found[ids[0]][2] == [
        f"duplicate of job {ids[2]} under the queued unique key 'u', accepted while that job "
        "waited for its key (fixed by migration 0011)"
    ]
    assert found[ids[5]][2] == []
    with psycopg.connect(database_url) as conn, pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(insert, ("blocked", "d", "w"))
