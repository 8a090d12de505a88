"""Reading from a replica: ``skiplock status`` and ``jobs list`` / ``show`` can read from a
streaming standby (``--read-url`` or ``SKIPLOCK_READ_URL``), keeping their load off the
primary. What they show is then as old as the standby's lag, so they say how far behind it
is (docs/failover.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from skiplock.sql import replica

READ_URL_ENV = "SKIPLOCK_READ_URL"


@dataclass(frozen=True)
class ReplicaState:
    """Whether the server read from is a standby, and its lag in seconds (None when
    unknown: nothing replayed yet)."""

    standby: bool
    lag_seconds: float | None

    def describe(self) -> str:
        if not self.standby:
            return "the read URL is not a replica (not in recovery): reading current data"
        if self.lag_seconds is None:
            return "reading from a replica that has replayed nothing yet: its lag is unknown"
        return f"reading from a replica, {self.lag_seconds:.1f} s behind its primary"


def replica_state(conn: psycopg.Connection[Any]) -> ReplicaState:
    row = conn.execute(replica.REPLICA_LAG).fetchone()
    assert row is not None
    lag = None if row[1] is None else max(0.0, float(row[1]))
    return ReplicaState(standby=bool(row[0]), lag_seconds=lag)
