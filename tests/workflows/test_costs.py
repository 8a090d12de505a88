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
