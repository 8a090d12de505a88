"""The clients of ``bench --scenarios enqueue-concurrent`` (skiplock/bench/enqueue_concurrent.py)
write what the figures claim: one order row and one job per committed transaction, through
each insert path, and the reference schema's jobs table has no insert trigger left enabled.

Counts only: how fast they commit is the bench's business. The smoke test runs the
scenario itself; this covers what it does not, the Python clients standing in for pgbench
on a machine without it.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock.bench.enqueue_concurrent import (
    COMMIT_PATHS,
    NO_TRIGGER_SCHEMA,
    PATH_SQL,
    PGBENCH_SCRIPT,
    ClientPool,
    commit_schemas,
)
from skiplock.bench.measure import percentile
from skiplock.bench.pgbench import pgbench_path, run_pgbench


def rows(conn: psycopg.Connection[Any], schema: str, table: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.timeout(120)
def test_each_python_client_transaction_commits_one_order_and_one_job(database_url: str) -> None:
    with (
        commit_schemas(database_url) as schemas,
        ClientPool(database_url, processes=2) as pool,
        psycopg.connect(database_url, autocommit=True) as conn,
    ):
        triggers = conn.execute(
            "SELECT tgenabled FROM pg_trigger WHERE tgrelid = %s::regclass "
            "AND NOT tgisinternal AND tgtype & 4 <> 0",
            (f"{NO_TRIGGER_SCHEMA}.jobs",),
        ).fetchall()
        assert triggers and {t for (t,) in triggers} == {"D"}, triggers
        for path in COMMIT_PATHS:
            for schema in schemas:
                counted = round(pool.run(schema, path, clients=3, seconds=0.3) * 0.3)
                jobs = rows(conn, schema, "jobs")
                assert rows(conn, schema, "bench_orders") == jobs, (path, schema)
                # Counted: the transactions committed before the deadline; each client's
                # last one commits after it.
                assert 0 < counted <= jobs <= counted + 3, (path, schema, counted, jobs)
                conn.execute(
                    sql.SQL("TRUNCATE {}, {}").format(
                        sql.Identifier(schema, "bench_orders"), sql.Identifier(schema, "jobs")
                    )
                )


@pytest.mark.timeout(120)
def test_a_failed_run_is_raised_and_the_client_pool_serves_the_next(database_url: str) -> None:
    with (
        commit_schemas(database_url) as (schema, _),
        ClientPool(database_url, processes=2) as pool,
    ):
        with pytest.raises(RuntimeError, match="no_such_schema"):
            pool.run("no_such_schema", PATH_SQL, clients=3, seconds=0.2)
        assert pool.run(schema, PATH_SQL, clients=3, seconds=0.2) > 0


@pytest.mark.timeout(120)
def test_the_pgbench_script_commits_one_order_and_one_job(database_url: str) -> None:
    binary = pgbench_path()
    if binary is None:
        pytest.skip("no pgbench on this machine: the bench falls back to Python clients")
    with (
        commit_schemas(database_url) as (schema, _),
        psycopg.connect(database_url, autocommit=True) as conn,
    ):
        script = (
            sql.SQL(PGBENCH_SCRIPT)
            .format(
                orders=sql.Identifier(schema, "bench_orders"), jobs=sql.Identifier(schema, "jobs")
            )
            .as_string(conn)
        )
        done = run_pgbench(binary, database_url, script, clients=2, transactions=25)
        assert done.transactions == 50 and done.tps > 0
        assert rows(conn, schema, "bench_orders") == rows(conn, schema, "jobs") == 50


def test_percentiles_are_the_median_and_nearest_ranks() -> None:
    values = [float(v) for v in range(200, 0, -1)]
    assert percentile(values, 0.5) == 100.5
    assert (percentile(values, 0.95), percentile(values, 0.99)) == (190.0, 198.0)
    assert percentile([3.0], 0.99) == 3.0
