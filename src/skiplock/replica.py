"""Reading from a replica: ``skiplock status``, ``jobs list`` / ``show`` and the dashboard
can read from a streaming standby (``--read-url`` or ``SKIPLOCK_READ_URL``), keeping their
load off the primary. What they show is then as old as the standby's lag, so they say how
far behind it is, or, when it does not stream from its primary, as of when it shows it
(docs/failover.md)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
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
    unknown: nothing replayed yet). A standby that does not stream from its primary
    (``streaming`` false: no WAL receiver, or one that is not streaming) shows the
    primary as of its last replayed commit, ``last_replay_at``, and falls further behind;
    ``receiver_status`` is its WAL receiver's status when one is there and visible."""

    standby: bool
    lag_seconds: float | None
    streaming: bool = True
    receiver_status: str | None = None
    last_replay_at: datetime | None = None

    def describe(self) -> str:
        if not self.standby:
            return "the read URL is not a replica (not in recovery): reading current data"
        if not self.streaming:
            why = (
                f"its WAL receiver is {self.receiver_status}"
                if self.receiver_status
                else "no WAL receiver"
            )
            if self.last_replay_at is None or self.lag_seconds is None:
                return (
                    f"reading from a replica that is not streaming from its primary ({why}) "
                    "and has replayed nothing yet: its lag is unknown"
                )
            since = self.last_replay_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
            return (
                f"reading from a replica that is not streaming from its primary ({why}): "
                f"it shows its primary as of {since}, its last replayed commit, "
                f"{self.lag_seconds:.1f} s ago, and falls further behind"
            )
        if self.lag_seconds is None:
            return "reading from a replica that has replayed nothing yet: its lag is unknown"
        return f"reading from a replica, {self.lag_seconds:.1f} s behind its primary"


def replica_state(conn: psycopg.Connection[Any]) -> ReplicaState:
    row = conn.execute(replica.REPLICA_LAG).fetchone()
    assert row is not None
    standby, lag, streaming, receiver_status, last_replay_at = row
    return ReplicaState(
        standby=bool(standby),
        lag_seconds=None if lag is None else max(0.0, float(lag)),
        streaming=bool(streaming) or not standby,
        receiver_status=receiver_status,
        last_replay_at=last_replay_at,
    )


def check_one_database(read_url: str | None, app: App | None) -> None:
    """A read URL names one replica: refuse it with an App whose queues live on several
    databases (queue_databases), for the CLI's commands and the dashboard alike."""
    if read_url and app is not None and app.queue_databases:
        raise ConfigurationError(
            "--read-url (or $SKIPLOCK_READ_URL, or create_app's read_url) names one replica, "
            "and this App's queues live on several databases: leave the read URL out, or "
            "leave out --app (app=) to read that one database"
        )
