"""What a step's end reads: its own row and its children's by index, never its siblings
(0027). Counted by the server for the test's own transaction (pg_stat_xact_user_tables),
not timed."""

from __future__ import annotations

import pytest

from workflows.conftest import Sem
from workflows.helpers import enqueue

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
            conn.execute(
                f'WITH gone AS (DELETE FROM "{s}".jobs WHERE id = %s RETURNING *) '
                f'INSERT INTO "{s}".job_history (id, queue, task, args, state, priority, '
                "attempts, max_attempts, errors, created_at) "
                "SELECT id, queue, task, args, 'completed', priority, attempts, max_attempts, "
                "errors, created_at FROM gone",
                (root_id,),
            )
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
