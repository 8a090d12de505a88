"""The ``unique``, ``ordered`` and ``keylimit`` scenarios: the drain with every job using one
feature (a unique key, an ordering key, a key limit), and its ratio to the plain drain
when that ran first (``vs_drain``)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.drain import Insert, drain_runs, versus_drain
from skiplock.bench.measure import Figure, Report, Settings

# Each feature's unique key, ordering key and key limit as SQL over the series number i
# (setup, not measured).
FEATURES = {
    "unique": ("'u' || i", "NULL", "1"),
    # Chains of ten: 10,000 keys for 100,000 jobs, each key's jobs one at a time in order.
    "ordered": ("NULL", "'o' || (i %% greatest(%(jobs)s / 10, 1))", "1"),
    # 1,000 customers, at most 3 jobs of each running at once.
    "keylimit": ("NULL", "'c' || (i %% 1000)", "3"),
}


def feature_jobs(feature: str) -> Insert:
    """Writes no-op jobs using ``feature`` in one statement. Keyed jobs go in as
    'blocked', exactly as enqueue writes them; the leader admits them."""
    unique, ordering, limit = FEATURES[feature]
    state = "available" if ordering == "NULL" else "blocked"

    def insert(conn: psycopg.Connection[Any], schema: str, count: int) -> None:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (task, args, state, unique_key, ordering_key, key_limit) "
                f"SELECT 'bench.noop', '{{{{}}}}'::jsonb, %(state)s, {unique}, {ordering}, "
                f"{limit} FROM generate_series(1, %(jobs)s) AS i"
            ).format(sql.Identifier(schema, "jobs")),
            {"state": state, "jobs": count},
        )

    return insert


def scenario(name: str, settings: Settings, report: Report) -> None:
    figure = Figure(
        f"drain, {name} jobs", "jobs/s", drain_runs(settings, insert=feature_jobs(name))
    )
    report.figure(versus_drain(figure, report))
