"""The claim reads the jobs_claim index in its own order: no sort, no scan of the table.

Plans are taken as the planner chooses them, over a few thousand rows in several queues and
states with fresh statistics, both as a custom plan (the values known) and as the generic
plan a prepared statement falls back to after a few executions. Everything rolls back.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock.completer import fenced_batch
from skiplock.sql import claim, complete, keys, maintenance, render, wakeup

pytestmark = pytest.mark.server_version

SCHEMA = "skiplock"
CLAIM_INDEX = "jobs_claim"


@pytest.fixture
def filled(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """5,000 jobs over three queues, seven tasks and every live state, then ANALYZE."""
    conn.execute(
        """
        INSERT INTO skiplock.jobs (queue, task, state, priority, run_at, attempts,
                                   worker_id, lease_expires_at)
        SELECT (ARRAY['default', 'emails', 'reports'])[1 + i % 3],
               't' || (i % 7),
               s.state,
               (i % 11) - 5,
               now() - (i % 100) * interval '1 minute'
                     + CASE WHEN s.state IN ('scheduled', 'retryable')
                            THEN interval '1 hour' ELSE interval '0' END,
               CASE WHEN s.state = 'available' THEN 0 ELSE 1 END,
               CASE WHEN s.state = 'running' THEN gen_random_uuid() END,
               CASE WHEN s.state = 'running' THEN now() + interval '1 minute' END
        FROM generate_series(1, 5000) AS i,
             LATERAL (SELECT (ARRAY['available', 'available', 'available', 'scheduled',
                                    'retryable', 'dead', 'running'])[1 + i % 7] AS state) AS s
        """
    )
    conn.execute("ANALYZE skiplock.jobs")
    return conn


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def picking_part(plan: dict[str, Any]) -> dict[str, Any]:
    """The part of the plan that chooses rows: the CTE of the claim, else the whole plan."""
    for node in nodes(plan):
        if node.get("Subplan Name") == "CTE picked":
            return node
    return plan


def outer_path(plan: dict[str, Any]) -> list[str]:
    """Node types from ``plan`` down its row-producing children (not InitPlans/SubPlans)."""
    path = [plan["Node Type"]]
    children = [
        child
        for child in plan.get("Plans", [])
        if child.get("Parent Relationship") in ("Outer", "Member")
    ]
    if children:
        path += outer_path(children[0])
    return path


def assert_reads_the_claim_index_in_order(plan: dict[str, Any]) -> dict[str, Any]:
    """Check the picking part of ``plan``; return its one scan of the jobs table."""
    picking = picking_part(plan)
    scans = [n for n in nodes(picking) if n.get("Relation Name") == "jobs"]
    kinds = [(n["Node Type"], n.get("Index Name")) for n in scans]
    assert kinds == [("Index Scan", CLAIM_INDEX)], kinds
    assert not [n["Node Type"] for n in nodes(picking) if "Sort" in n["Node Type"]]
    # Rows flow straight from the index scan through the row locks to the limit.
    path = outer_path(picking)
    assert path[-1] == "Index Scan"
    assert "LockRows" in path
    assert set(path) <= {"Limit", "LockRows", "Result", "Index Scan"}, path
    return scans[0]


def explain(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> Any:
    """The custom plan. Never prepared: psycopg would prepare a statement it has run five
    times, and the server could then reuse a plan made under earlier statistics."""
    row = conn.execute("EXPLAIN (FORMAT JSON) " + statement, params, prepare=False).fetchone()
    assert row is not None
    return row[0][0]["Plan"]


def explain_generic(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> Any:
    """The generic plan: PREPARE with $n placeholders, then EXPLAIN EXECUTE."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    name = f"claim_{uuid.uuid4().hex[:8]}"
    conn.execute(f"PREPARE {name} AS " + re.sub(r"%\((\w+)\)s", number, statement))
    conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    values = sql.SQL(", ").join(sql.Literal(params[n]) for n in names)
    row = conn.execute(
        sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE {} ({})").format(sql.Identifier(name), values)
    ).fetchone()
    assert row is not None
    return row[0][0]["Plan"]


def claim_params(limit: int, exclude: list[str]) -> dict[str, Any]:
    return {
        "queue": "default",
        "exclude_tasks": exclude,
        "limit": limit,
        "worker_id": uuid.uuid4(),
        "lease_seconds": 30.0,
        "governed": False,
    }


PLANNERS = {"custom": explain, "generic": explain_generic}


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("limit", [1, 10, 100])
@pytest.mark.parametrize("exclude", [[], ["t1", "t2"]])
def test_the_lease_claim_reads_the_claim_index_in_order(
    filled: psycopg.Connection[Any], planner: str, limit: int, exclude: list[str]
) -> None:
    statement = render(claim.JOB_CLAIM_BATCH, SCHEMA)

    plan = PLANNERS[planner](filled, statement, claim_params(limit, exclude))

    assert plan["Node Type"] == "ModifyTable"
    assert_reads_the_claim_index_in_order(plan)


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_the_resumed_claim_starts_the_index_scan_at_the_cursor(
    filled: psycopg.Connection[Any], planner: str
) -> None:
    statement = render(claim.JOB_CLAIM_BATCH_AFTER, SCHEMA)
    params = claim_params(10, []) | {
        "after_priority": -2,
        "after_run_at": datetime.now(UTC),
        "after_id": 100,
    }

    plan = PLANNERS[planner](filled, statement, params)

    scan = assert_reads_the_claim_index_in_order(plan)
    # The position is an index condition (where the scan starts), not a filter.
    assert "ROW(priority, run_at, id) >" in scan["Index Cond"]


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("limit", [1, 10])
def test_the_transactional_lock_reads_the_claim_index_in_order(
    filled: psycopg.Connection[Any], planner: str, limit: int
) -> None:
    statement = render(claim.JOB_LOCK_BATCH, SCHEMA)
    params = {
        "queue": "default",
        "tasks": ["t1", "t2", "t3"],
        "limit": limit,
        "governed": False,
    }

    plan = PLANNERS[planner](filled, statement, params)

    assert_reads_the_claim_index_in_order(plan)


# -- plans that do not depend on the statistics ----------------------------------------


def misleading(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """What ANALYZE records for a busy queue table while VACUUM is held back: a handful of
    live rows among many dead ones, so the planner takes the table for tiny although
    walking it (or its primary key) reads every dead version."""
    conn.execute(
        "INSERT INTO skiplock.jobs (task, state) "
        "SELECT 'gone', 'dead' FROM generate_series(1, 20000)"
    )
    conn.execute("DELETE FROM skiplock.jobs WHERE task = 'gone'")
    conn.execute("UPDATE pg_class SET reltuples = 1 WHERE oid = 'skiplock.jobs'::regclass")
    # As worker sessions run (claim.WORKER_SESSION_OPTIONS).
    assert "-c enable_seqscan=off" in claim.WORKER_SESSION_OPTIONS
    conn.execute("SET LOCAL enable_seqscan = off")
    return conn


def fenced(**extra: Any) -> dict[str, Any]:
    """A fenced batch of three jobs (completer.fenced_batch), with per-job ``extra``."""
    entries = {job_id: {"attempt": 1, "progress": None, **extra} for job_id in (11, 12, 13)}
    return {**fenced_batch(entries), "worker_id": uuid.uuid4()}


ROBUST = {
    "claim": (claim.JOB_CLAIM_BATCH, claim_params(50, [])),
    "complete": (complete.JOB_COMPLETE_MANY_IF_LEASED, fenced(result=None)),
    "fail": (
        complete.JOB_FAIL_MANY_IF_LEASED,
        fenced(dead=False, delay=1.0, error={}),
    ),
    "snooze": (complete.JOB_SNOOZE_MANY_IF_LEASED, fenced(delay=1.0)),
    "cancel": (complete.JOB_CANCEL_MANY_IF_LEASED, fenced()),
    "heartbeat": (
        maintenance.JOB_EXTEND_LEASES_SKIP_LOCKED,
        {**fenced(), "lease_seconds": 30.0},
    ),
    "release": (complete.JOB_RELEASE_MANY_IF_LEASED, {**fenced(), "channel": "c"}),
    "mark started": (claim.JOB_MARK_STARTED, fenced()),
    "promote": (maintenance.JOB_PROMOTE_DUE, {"limit": 1000, "channel": "c"}),
    "late commits": (
        wakeup.JOB_LATE_COMMITS,
        {
            "queues": ["default", "emails"],
            "xmax": ["1000", "1000"],
            "after_id": [0, 0],
            "p_queues": ["default"],
            "p_xids": ["990"],
            "p_after_id": [0],
            "exclude_tasks": ["t1"],
            "limit": 1000,
        },
    ),
}


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("statistics", ["true", "tiny"])
def test_the_late_commit_read_starts_at_the_recent_end_of_its_index(
    filled: psycopg.Connection[Any], planner: str, statistics: str
) -> None:
    """Decision 023: both parts of the read are index scans of jobs_enqueued bounded by
    the previous snapshot (never jobs_claim or the primary key, which would walk every
    ready job, or every entry VACUUM could not remove yet), whatever the statistics."""
    if statistics == "tiny":
        misleading(filled)
    assert "-c enable_sort=off" in wakeup.WAKEUP_SESSION_OPTIONS  # as the session runs
    filled.execute("SET LOCAL enable_sort = off")
    template, params = ROBUST["late commits"]
    plan = PLANNERS[planner](filled, render(template, SCHEMA), params)

    scans = [
        n for n in nodes(plan) if n.get("Relation Name") == "jobs" and "Scan" in n["Node Type"]
    ]
    assert len(scans) == 2, [(n["Node Type"], n.get("Index Name")) for n in scans]
    for scan in scans:
        assert scan["Node Type"] in ("Index Scan", "Bitmap Heap Scan"), scan["Node Type"]
        index = scan if scan["Node Type"] == "Index Scan" else scan["Plans"][0]
        assert index.get("Index Name") == "jobs_enqueued", index.get("Index Name")
        assert "enqueued_xid" in index["Index Cond"], index["Index Cond"]


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("name", sorted(ROBUST))
def test_no_statement_walks_the_jobs_table_when_the_statistics_say_it_is_tiny(
    filled: psycopg.Connection[Any], planner: str, name: str
) -> None:
    """Measured on PostgreSQL 18 under a held VACUUM horizon: with such statistics the
    claim and the completion joined by walking the whole primary key, 1,400 index entries
    read per job. Every scan of jobs must have an index condition."""
    template, params = ROBUST[name]
    plan = PLANNERS[planner](misleading(filled), render(template, SCHEMA), params)

    scans = [
        n for n in nodes(plan) if n.get("Relation Name") == "jobs" and "Scan" in n["Node Type"]
    ]
    assert scans
    for scan in scans:
        assert scan["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan"), (
            scan["Node Type"],
            scan.get("Alias"),
            scan.get("Filter"),
        )
        if scan["Node Type"] != "Bitmap Heap Scan":
            assert scan.get("Index Cond"), (scan["Node Type"], scan.get("Index Name"))


# -- admission, inside keys_admit (migration 0015) -------------------------------------


def nested_plans(conn: psycopg.Connection[Any], statement: str, params: Any) -> list[Any]:
    """The plans of the statements run inside functions that ``statement`` calls, as
    auto_explain reports them (to this session: client_min_messages)."""
    messages: list[str] = []
    conn.add_notice_handler(lambda d: messages.append(d.message_primary or ""))
    for setting in (
        "LOAD 'auto_explain'",
        "SET LOCAL auto_explain.log_min_duration = 0",
        "SET LOCAL auto_explain.log_nested_statements = on",
        "SET LOCAL auto_explain.log_format = json",
        "SET LOCAL client_min_messages = log",
    ):
        conn.execute(setting)
    conn.execute(statement, params).fetchall()
    conn.execute("SET LOCAL client_min_messages = notice")
    return [
        json.loads(m.split("plan:", 1)[1])["Plan"]
        for m in messages
        if m.startswith("duration") and "plan:" in m
    ]


@pytest.mark.parametrize("statistics", ["tiny", "true"])
@pytest.mark.parametrize("session", ["worker", "any"])
@pytest.mark.parametrize("mode", ["auto", "force_generic_plan"])
def test_admission_reads_the_jobs_table_by_index_conditions_only(
    filled: psycopg.Connection[Any], mode: str, session: str, statistics: str
) -> None:
    """keys_admit's statement (0015), run by a worker's completion, the leader or any
    session that deletes a keyed job, finds every row of the jobs table through an index
    condition or by its address: never a walk of the table, nor a bitmap scan (which,
    while VACUUM is held back, reads a key's dead versions from the heap on every
    admission instead of marking them once), whatever the statistics, the plan (custom,
    or the generic one a session falls back to) and the session's settings."""
    conn = filled
    # Keys with admitted jobs of many versions (limit 50), and a few waiting ones each.
    conn.execute(
        "INSERT INTO skiplock.jobs (task, state, ordering_key, key_limit) "
        "SELECT 't', CASE WHEN i <= 150 THEN 'available' ELSE 'blocked' END, "
        "       'k' || (i % 3), 50 "
        "FROM generate_series(1, 180) AS i"
    )
    if statistics == "tiny":
        misleading(conn)
    else:
        conn.execute("ANALYZE skiplock.jobs")
    if session == "any":
        conn.execute("SET LOCAL enable_seqscan = on")
    conn.execute(sql.SQL("SET LOCAL plan_cache_mode = {}").format(sql.Identifier(mode)))
    for _ in range(7):  # a cached plan of the session, past the custom ones
        plans = nested_plans(conn, render(keys.ADMIT, SCHEMA), {"keys": ["k0", "k1", "k9"]})
    admitting = [
        plan
        for plan in plans
        if any(n.get("Relation Name") == "jobs" for n in nodes(plan))
        and any(n["Node Type"] == "ModifyTable" for n in nodes(plan))
    ]
    assert len(admitting) == 1
    scans = [
        n
        for n in nodes(admitting[0])
        if n.get("Relation Name") == "jobs" and "Scan" in n["Node Type"]
    ]
    assert len(scans) >= 4
    for scan in scans:
        assert scan["Node Type"] in ("Index Scan", "Index Only Scan", "Tid Scan"), scan
        assert scan.get("Index Cond") or scan.get("TID Cond"), scan


# -- no JIT on a worker's statements ----------------------------------------------------

MAINTENANCE: dict[str, tuple[str, dict[str, Any]]] = {
    "gone": (maintenance.WORKERS_GONE, {"worker_id": uuid.uuid4()}),
    "orphaned": (
        maintenance.JOB_RESCUE_ORPHANED,
        {"worker_id": uuid.uuid4(), "channel": "c", "workers": [uuid.uuid4()]},
    ),
    "expired": (maintenance.JOB_RESCUE_EXPIRED, {"worker_id": uuid.uuid4(), "channel": "c"}),
    "stray": (maintenance.JOB_RESCUE_STRAY, {"worker_id": uuid.uuid4(), "channel": "c"}),
    "cancel abandoned": (
        maintenance.JOB_CANCEL_ABANDONED,
        {"worker_id": uuid.uuid4(), "channel": "c"},
    ),
}


@pytest.mark.parametrize("name", sorted({**ROBUST, **MAINTENANCE}))
def test_no_worker_statement_is_compiled_by_jit(filled: psycopg.Connection[Any], name: str) -> None:
    """Worker sessions refuse sequential scans (WORKER_SESSION_OPTIONS), which prices one
    at 10^10: a statement that still needs one (the largest lease among the registered
    workers, read by the stray rescue) then passes jit_above_cost, and its compilation
    cost about 300 ms of server CPU on every run, tripling PostgreSQL's CPU per job in
    `bench --scenarios lowconc`. Planned as a worker session plans it, no statement is
    compiled."""
    conn = filled
    if conn.execute("SELECT pg_jit_available()").fetchone() != (True,):
        pytest.skip("this server cannot compile with JIT")
    for name_value in re.findall(r"-c (\w+)=(\S+)", claim.WORKER_SESSION_OPTIONS):
        conn.execute("SELECT set_config(%s, %s, true)", name_value)
    statements: dict[str, tuple[str, dict[str, Any]]] = {**ROBUST, **MAINTENANCE}
    template, params = statements[name]

    row = conn.execute(
        "EXPLAIN (FORMAT JSON) " + render(template, SCHEMA), params, prepare=False
    ).fetchone()

    assert row is not None
    assert "JIT" not in row[0][0], row[0][0]["JIT"]
