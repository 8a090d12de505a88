"""Migrations: every path to head gives the same schema, old rows stay workable, a missing
migration is named with the command that fixes it, and concurrent migrators are safe.

Each test works in its own schema (``mig_<random>``), dropped afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import StartWorker, wait_until
from skiplock import client
from skiplock.migrate import Migration, available_migrations, head_version

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


def test_a_failing_migration_leaves_the_schema_as_it_was(
    database_url: str, scratch_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = skiplock.App(database_url, schema=scratch_schema)
    app.migrate(target=1)
    before = catalog_dump(database_url, scratch_schema)
    broken = Migration(
        head_version() + 1, "broken", "CREATE TABLE half_done (x int);\nSELECT 1 / 0;\n"
    )
    shipped = available_migrations()
    monkeypatch.setattr("skiplock.migrate.available_migrations", lambda: [*shipped, broken])

    with pytest.raises(psycopg.errors.DivisionByZero):
        app.migrate()

    assert catalog_dump(database_url, scratch_schema) == before
