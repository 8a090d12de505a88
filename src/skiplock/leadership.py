"""Leader election bookkeeping: pure, the worker does the I/O.

A worker is leader while the row in the leader table is its and unexpired. It believes
so only until a margin before the lease it last wrote runs out, on its own monotonic
clock, so a worker that cannot reach the database stops acting as leader before anyone
else can be elected: losing the connection means losing leadership.
"""

from __future__ import annotations

import random


class Leadership:
    def __init__(self, ttl: float, rng: random.Random) -> None:
        self.ttl = ttl
        self._rng = rng
        self._until = 0.0
        self.elections = 0

    def is_leader(self, now: float) -> bool:
        return now < self._until

    def record(self, *, won: bool, asked_at: float) -> None:
        """The result of LEADER_ELECT sent at ``asked_at`` (monotonic seconds)."""
        if won:
            if not self.is_leader(asked_at):
                self.elections += 1
            # The row says ttl from the server's now(), which is after asked_at; keep a
            # third of the ttl as margin for clock rates and round-trip time.
            self._until = asked_at + self.ttl * 2 / 3
        else:
            self._until = 0.0

    def lose(self) -> None:
        self._until = 0.0

    def next_attempt_in(self, now: float, follower_every: float) -> float:
        """Leaders renew at a third of the ttl; followers try about every
        ``follower_every`` seconds (a dead leader is replaced that fast), with jitter so
        that they do not all race for the row in the same instant."""
        if self.is_leader(now):
            return self.ttl / 3
        return follower_every * (0.5 + self._rng.random())
