"""Pure decisions after a failed attempt: back-off timing and retry-or-dead.

No connection in sight: time and randomness are arguments, so tests pin them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from skiplock.errors import ConfigurationError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off with full jitter and a cap.

    The delay before attempt ``n + 1`` is ``min(cap, base * factor ** (n - 1))``, scaled by
    a random factor in ``[1 - jitter, 1]`` so that jobs which failed together do not all
    retry in the same instant.
    """

    base: float = 1.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.base < 0:
            raise ConfigurationError(f"RetryPolicy.base must be >= 0, got {self.base}")
        if self.factor < 1:
            raise ConfigurationError(f"RetryPolicy.factor must be >= 1, got {self.factor}")
        if self.cap < self.base:
            raise ConfigurationError(f"RetryPolicy.cap ({self.cap}) must be >= base ({self.base})")
        if not 0 <= self.jitter <= 1:
            raise ConfigurationError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        exponent = max(attempt - 1, 0)
        try:
            raw = min(self.cap, self.base * self.factor**exponent)
        except OverflowError:  # a steep policy after many attempts: past the cap it is flat
            raw = self.cap
        return raw * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True)
class FailureDecision:
    """What happens to a job after a failed attempt."""

    dead: bool
    run_at: datetime


def decide_failure(
    *,
    attempt: int,
    max_attempts: int,
    policy: RetryPolicy,
    now: datetime,
    rng: random.Random,
    retry_at: datetime | None = None,
) -> FailureDecision:
    """Retry with back-off (or at ``retry_at`` when the handler asked), or park as dead."""
    if attempt >= max_attempts:
        return FailureDecision(dead=True, run_at=now)
    if retry_at is not None:
        return FailureDecision(dead=False, run_at=max(retry_at, now))
    return FailureDecision(dead=False, run_at=now + timedelta(seconds=policy.delay(attempt, rng)))


def retry_at_from(after: float | timedelta | datetime | None, now: datetime) -> datetime | None:
    """Turn a handler's ``Retry(after=...)`` into an absolute time."""
    if after is None:
        return None
    if isinstance(after, datetime):
        return after
    if isinstance(after, timedelta):
        return now + after
    return now + timedelta(seconds=float(after))
