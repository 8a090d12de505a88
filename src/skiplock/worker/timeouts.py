"""How long the worker's background statements may wait, in one place.

Every statement of the leader and of maintenance runs on connections opened with
``lock_timeout`` and ``statement_timeout``: a user's transaction holding a row or a unique
key that one of them needs ends that pass (it is tried again on the next one) instead of
holding up the duty, and never the heartbeats, which have a connection and bounds of
their own. Session settings of dedicated connections rather than ``SET LOCAL`` in each
transaction: the same bound on every statement, at no round trip per pass. History's
partition DDL sets its own, shorter, lock timeout (history.DDL_LOCK_TIMEOUT_MS).
"""

from __future__ import annotations

from dataclasses import dataclass

from skiplock.sql.claim import WORKER_SESSION_OPTIONS


@dataclass(frozen=True)
class Bounds:
    """``lock_timeout`` and ``statement_timeout``, in seconds."""

    lock: float
    statement: float

    def options(self, base: str = WORKER_SESSION_OPTIONS) -> str:
        """libpq ``options`` for a connection whose every statement keeps these bounds."""
        return (
            f"{base} -c lock_timeout={_ms(self.lock)} -c statement_timeout={_ms(self.statement)}"
        ).strip()


# The leader's duties (election, rescue, admission, cron, history), promotion and the
# cursor probe.
MAINTENANCE = Bounds(lock=2.0, statement=30.0)


# The wake-up session's statements (worker/wakeup.py): its lock tries never wait, and a
# late-commit read that ran this long would better be cut and tried again.
WAKEUP = Bounds(lock=1.0, statement=5.0)


def heartbeat_bounds(every: float) -> Bounds:
    """A heartbeat waits at most one beat for a lock and two for a statement: a beat that
    gives up is sent again on the next, well before the lease (three beats) runs out."""
    return Bounds(
        lock=min(MAINTENANCE.lock, max(every, 0.05)),
        statement=min(MAINTENANCE.statement, max(2 * every, 1.0)),
    )


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)
