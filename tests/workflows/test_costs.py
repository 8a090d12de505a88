"""What a step's end reads: its own row and its children's by index, never its siblings
(0027); and what it writes: each row once (0037). Counted by the server for the test's own
transaction (pg_stat_xact_user_tables, its WAL records), not timed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from workflows.conftest import Sem
from workflows.helpers import complete_by_hand, enqueue

pytestmark = pytest.mark.server_version

PARENTS = 2000
ENDED = 100


def test_ending_parents_of_a_large_fan_in_reads_no_row_per_sibling(sem: Sem) -> None:
    """A fan-in written a moment ago (no statistics yet): ending 100 of its 2,000 parents
    fetches a few rows per parent (under 50), not the workflow's 2,000 steps per parent."""

    @sem.app.task(name="noop")
    def noop() -> None: ...

    wf = sem.app.workflow()
    parents = [wf.add(noop.job(), name=f"p{n}") for n in range(PARENTS)]
    wf.add(noop.job(), name="child", after=parents)
    ref = enqueue(sem, wf)
    ended = [int(ref.steps[f"p{n}"]) for n in range(ENDED)]

    with sem.connect(autocommit=False) as conn:
        conn.execute(
            f'SELECT "{sem.schema}".workflow_steps_end(%s::bigint[], %s::text[])',
            (ended, ["completed"] * ENDED),
        )
        row = conn.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
            "FROM pg_stat_xact_user_tables WHERE schemaname = %s AND relname = 'workflow_steps'",
            (sem.schema,),
        ).fetchone()
        pending = conn.execute(
            f'SELECT pending FROM "{sem.schema}".workflow_steps WHERE job_id = %s',
            (int(ref.steps["child"]),),
        ).fetchone()
        conn.rollback()

    assert pending is not None and pending[0] == PARENTS - ENDED
    assert row is not None
    assert row[0] < 50 * ENDED, f"{row[0]} rows read to end {ENDED} parents"


PAST_DAYS = 3


@pytest.mark.parametrize(
    ("history", "outcome"),
    [("written by the same statement", "completed"), ("none (deleted by hand)", "cancelled")],
)
def test_a_step_end_looks_for_its_history_row_in_todays_partitions_only(
    sem: Sem, history: str, outcome: str
) -> None:
    """The row a step's end reads its outcome from was written by the same statement,
    today: partitions of past days (a week of them at the default retention) are never
    searched, and the outcome is still found."""

    @sem.app.task(name="noop")
    def noop() -> None: ...

    wf = sem.app.workflow()
    root = wf.add(noop.job(), name="root")
    wf.add(noop.job(), name="child", after=[root])
    ref = enqueue(sem, wf)
    root_id = int(ref.steps["root"])
    s = sem.schema

    with sem.connect(autocommit=False) as conn:
        days = conn.execute(
            f"SELECT \"{s}\".history_partition_create((now() AT TIME ZONE 'UTC')::date - k), "
            "'job_history_p' || to_char((now() AT TIME ZONE 'UTC')::date - k, 'YYYYMMDD') "
            "FROM generate_series(1, %s) AS k",
            (PAST_DAYS,),
        ).fetchall()
        conn.commit()
        past = [row[1] for row in days]
        scans = (
            "SELECT relname, coalesce(idx_scan, 0) + coalesce(seq_scan, 0) "
            "FROM pg_stat_xact_user_tables WHERE schemaname = %s AND relname = ANY(%s)"
        )
        # Counts not yet sent to the server's statistics (the partitions' index builds,
        # for one) are in these too: what counts is what the step's end adds.
        before = conn.execute(scans, (s, past)).fetchall()
        if history.startswith("written"):
            complete_by_hand(conn, s, [root_id])
        else:
            conn.execute(f'DELETE FROM "{s}".jobs WHERE id = %s', (root_id,))
        after = conn.execute(scans, (s, past)).fetchall()
        ended = conn.execute(
            f'SELECT outcome FROM "{s}".workflow_steps WHERE job_id = %s', (root_id,)
        ).fetchone()
        conn.rollback()

    assert ended == (outcome,)
    assert len(before) == PAST_DAYS
    assert sorted(after) == sorted(before), (before, after)


def test_a_step_end_writes_each_row_it_changes_without_locking_it_first(sem: Sem) -> None:
    """The ended step, its children and its workflow are each locked by the UPDATE that
    writes them (in id order, as the plan reads them), not first by a FOR UPDATE: a lock
    is a WAL record and a write of the row of its own, per row. The transaction that
    completes a root of three children writes no row lock, and still releases them."""

    @sem.app.task(name="noop")
    def noop() -> None: ...

    wf = sem.app.workflow()
    root = wf.add(noop.job(), name="root")
    children = [wf.add(noop.job(), name=f"c{n}", after=[root]) for n in range(3)]
    wf.add(noop.job(), name="last", after=children)
    ref = enqueue(sem, wf)
    s = sem.schema

    with sem.connect(autocommit=False) as conn:
        # One extension per database, and the suite's workers share it.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('pg_walinspect'))")
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect SCHEMA public")
        conn.commit()
        start = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        complete_by_hand(conn, s, [int(ref.steps["root"])])
        xid = conn.execute("SELECT pg_current_xact_id()::text::xid::text").fetchone()
        conn.commit()
        assert start is not None and xid is not None
        records = conn.execute(
            "SELECT resource_manager, record_type, count(*) "
            "FROM public.pg_get_wal_records_info(%s, pg_current_wal_flush_lsn()) "
            "WHERE xid::text = %s GROUP BY 1, 2 ORDER BY 1, 2",
            (start[0], xid[0]),
        ).fetchall()
        conn.rollback()

    assert [sem.state_of(ref.steps[f"c{n}"]) for n in range(3)] == ["available"] * 3
    assert sem.state_of(ref.steps["last"]) == "waiting"
    assert any(rmgr == "Heap" for rmgr, _, _ in records), records  # the WAL was read
    locks = [row for row in records if row[1].startswith("LOCK")]
    assert locks == [], records


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


@pytest.mark.parametrize("statistics", ["none yet", "analyzed"])
def test_each_write_of_a_step_end_takes_its_rows_in_id_order(sem: Sem, statistics: str) -> None:
    """No FOR UPDATE orders the locks (0037): each UPDATE of a step's end locks rows as its
    plan reads them, so that plan must read its targets in id order, by a nested loop
    whose outer side is the sorted subquery and whose inner side is the target's primary
    key. Read from the plans auto_explain sends for the statements of the completion of
    two workflows' roots, with the tables new (no statistics) and analyzed."""

    @sem.app.task(name="noop")
    def noop() -> None: ...

    roots = []
    for _ in range(2):
        wf = sem.app.workflow()
        root = wf.add(noop.job(), name="root")
        children = [wf.add(noop.job(), name=f"c{n}", after=[root]) for n in range(5)]
        wf.add(noop.job(), name="last", after=children)
        roots.append(int(enqueue(sem, wf).steps["root"]))
    s = sem.schema
    if statistics == "analyzed":
        sem.execute("ANALYZE {schema}.jobs, {schema}.workflow_steps, {schema}.workflows")
    plans: list[dict[str, Any]] = []

    def collect(notice: psycopg.errors.Diagnostic) -> None:
        text = notice.message_primary or ""
        if "plan:" in text:
            plans.append(json.loads(text.split("plan:", 1)[1])["Plan"])

    with sem.connect(autocommit=False) as conn:
        conn.execute("LOAD 'auto_explain'")
        for name, value in [
            ("log_min_duration", "0"),
            ("log_nested_statements", "on"),
            ("log_format", "json"),
            ("log_level", "notice"),
        ]:
            conn.execute(f"SET auto_explain.{name} = {value}")
        conn.add_notice_handler(collect)
        complete_by_hand(conn, s, roots)
        released = conn.execute(
            f"SELECT count(*) FROM \"{s}\".jobs WHERE state = 'available'"
        ).fetchone()
        conn.rollback()

    assert released == (10,)
    updates = [
        node
        for plan in plans
        for node in _nodes(plan)
        if node["Node Type"] == "ModifyTable"
        and node["Operation"] == "Update"
        and node["Relation Name"] in ("workflow_steps", "workflows")
    ]
    # The marks, the children's counts and the workflows.
    assert sorted(u["Relation Name"] for u in updates) == [
        "workflow_steps",
        "workflow_steps",
        "workflows",
    ], plans
    for update in updates:
        (join,) = update["Plans"]
        assert join["Node Type"] == "Nested Loop", update
        outer, inner = join["Plans"]
        # The subquery's ORDER BY holds whichever path gives it (a sort, or an index
        # read in that order); a subquery that sorts is never flattened into the join.
        assert outer["Node Type"] == "Subquery Scan", update
        if inner["Node Type"] == "Memoize":  # a cache of the probes, in the outer's order
            (inner,) = inner["Plans"]
        assert inner["Node Type"] == "Index Scan", update
        assert inner["Relation Name"] == update["Relation Name"], update
        assert inner["Index Name"] == f"{update['Relation Name']}_pkey", update
