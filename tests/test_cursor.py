"""The claim cursor's bookkeeping (cursor.py): pure, no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from skiplock.control import Wakeup
from skiplock.cursor import ClaimCursor, Position

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float, priority: int = 0, job_id: int = 1) -> Position:
    return (priority, T0 + timedelta(seconds=seconds), job_id)


def test_a_rewind_while_a_claim_is_in_flight_is_not_overtaken_by_it() -> None:
    """The claim's snapshot may predate the announced job: before, the claim's advance
    passed it again, and the job waited for the probe (5 s). With 8 sessions enqueuing
    1,500 jobs/s, 0.4 % of the jobs did (decision 016)."""
    cursor = ClaimCursor()
    cursor.start()
    cursor.advance([at(1, job_id=1)])

    assert cursor.start() == at(1, job_id=1)
    cursor.rewind(Wakeup("default", 0, T0 + timedelta(seconds=2)))  # while in flight
    cursor.advance([at(3, job_id=3), at(4, job_id=4)])

    assert cursor.position == (0, T0 + timedelta(seconds=2, microseconds=-1), 0)
    cursor.start()
    cursor.advance([at(5, job_id=5)])  # the next claim moves on as usual
    assert cursor.position == at(5, job_id=5)


def test_a_probe_finding_while_a_claim_is_in_flight_is_kept_too() -> None:
    cursor = ClaimCursor()
    cursor.start()
    cursor.advance([at(1, job_id=1)])

    cursor.start()
    cursor.rewind_to(at(0.5, job_id=9))
    cursor.advance([at(3, job_id=3)])

    assert cursor.position == at(0.5, job_id=8)


def test_a_rewind_between_claims_only_moves_the_next_start() -> None:
    cursor = ClaimCursor()
    cursor.start()
    cursor.advance([at(5, job_id=5)])
    cursor.rewind(Wakeup("default", 0, T0 + timedelta(seconds=2)))

    assert cursor.start() == (0, T0 + timedelta(seconds=2, microseconds=-1), 0)
    cursor.advance([at(2, job_id=2), at(6, job_id=6)])
    assert cursor.position == at(6, job_id=6)
