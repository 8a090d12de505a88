"""Reading from a replica: ``skiplock status``, ``jobs list`` / ``show`` and the dashboard
can read from a streaming standby (``--read-url`` or ``SKIPLOCK_READ_URL``), keeping their
load off the primary. What they show is then as old as the standby's lag, so they say how
far behind it is (docs/failover.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from skiplock.errors import ConfigurationError
from skiplock.sql import replica

if TYPE_CHECKING:
    from skiplock.app import App

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


def check_one_database(read_url: str | None, app: App | None) -> None:
    """A read URL names one replica: refuse it with an App whose queues live on several
    databases (queue_databases), for the CLI's commands and the dashboard alike."""
    if read_url and app is not None and app.queue_databases:
        raise ConfigurationError(
            "--read-url (or $SKIPLOCK_READ_URL, or create_app's read_url) names one replica, "
            "and this App's queues live on several databases: leave the read URL out, or "
            "leave out --app (app=) to read that one database"
        )
