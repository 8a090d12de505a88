"""Retry decisions are pure: time and randomness are arguments, so no database is needed."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

import skiplock
from skiplock.executor import failure_outcome
from skiplock.retry import RetryPolicy, decide_failure, retry_at_from

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


class FixedRandom(random.Random):
    """A jitter source whose every draw is ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_without_jitter_delays_grow_exponentially_from_base() -> None:
    policy = RetryPolicy(base=2.0, factor=3.0, cap=10_000.0, jitter=0.0)

    delays = [policy.delay(attempt, random.Random(1)) for attempt in range(1, 7)]

    assert delays == [2.0, 6.0, 18.0, 54.0, 162.0, 486.0]


def test_delays_stop_growing_at_the_cap() -> None:
    policy = RetryPolicy(base=1.0, factor=2.0, cap=60.0, jitter=0.0)

    delays = [policy.delay(attempt, random.Random(1)) for attempt in (6, 7, 8, 50)]

    assert delays == [32.0, 60.0, 60.0, 60.0]


def test_an_absurd_attempt_number_is_capped_not_an_overflow() -> None:
    policy = RetryPolicy(base=1.0, factor=10.0, cap=3600.0, jitter=0.0)

    assert policy.delay(10**6, random.Random(1)) == 3600.0


def test_a_steep_policy_is_capped_not_an_overflow() -> None:
    policy = RetryPolicy(base=1.0, factor=10.0, cap=3600.0, jitter=0.0)

    assert policy.delay(400, random.Random(1)) == 3600.0


def test_jitter_scales_the_delay_down_by_the_drawn_fraction() -> None:
    policy = RetryPolicy(base=8.0, factor=2.0, cap=1000.0, jitter=0.5)

    assert policy.delay(1, FixedRandom(0.0)) == 8.0
    assert policy.delay(1, FixedRandom(0.5)) == 6.0
    assert policy.delay(3, FixedRandom(0.5)) == 24.0


def test_the_same_seed_gives_the_same_delays() -> None:
    policy = RetryPolicy()

    first = [policy.delay(n, random.Random(42)) for n in range(1, 10)]
    second = [policy.delay(n, random.Random(42)) for n in range(1, 10)]

    assert first == second


policies = st.builds(
    lambda base, factor, extra, jitter: RetryPolicy(
        base=base, factor=factor, cap=base + extra, jitter=jitter
    ),
    base=st.floats(min_value=0, max_value=1e4),
    factor=st.floats(min_value=1, max_value=10),
    extra=st.floats(min_value=0, max_value=1e5),
    jitter=st.floats(min_value=0, max_value=1),
)


# Attempts stay below 300 here: factor**attempt overflows a float beyond that (see the
# xfail test below); the bounds themselves hold for any attempt.
@given(policy=policies, attempt=st.integers(min_value=1, max_value=300), seed=st.integers())
def test_jittered_delay_stays_within_its_bounds(
    policy: RetryPolicy, attempt: int, seed: int
) -> None:
    unjittered = RetryPolicy(policy.base, policy.factor, policy.cap, jitter=0.0)
    ceiling = unjittered.delay(attempt, random.Random(seed))

    delay = policy.delay(attempt, random.Random(seed))

    assert ceiling <= policy.cap
    assert ceiling * (1 - policy.jitter) <= delay <= ceiling


@given(policy=policies, attempt=st.integers(min_value=1, max_value=60))
def test_unjittered_delays_never_shrink_as_attempts_grow(policy: RetryPolicy, attempt: int) -> None:
    flat = RetryPolicy(policy.base, policy.factor, policy.cap, jitter=0.0)

    assert flat.delay(attempt, random.Random(0)) <= flat.delay(attempt + 1, random.Random(0))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"base": -1.0}, "base must be >= 0"),
        ({"factor": 0.5}, "factor must be >= 1"),
        ({"base": 10.0, "cap": 5.0}, "must be >= base"),
        ({"jitter": 1.5}, "jitter must be in"),
        ({"jitter": -0.1}, "jitter must be in"),
    ],
)
def test_an_impossible_policy_is_refused_when_defined(
    options: dict[str, float], message: str
) -> None:
    with pytest.raises(skiplock.ConfigurationError, match=message):
        RetryPolicy(**options)


def test_failure_before_the_last_attempt_is_retried_after_the_back_off() -> None:
    policy = RetryPolicy(base=30.0, factor=2.0, cap=3600.0, jitter=0.0)

    decision = decide_failure(
        attempt=2, max_attempts=5, policy=policy, now=NOW, rng=random.Random(0)
    )

    assert not decision.dead
    assert decision.run_at == NOW + timedelta(seconds=60)


@pytest.mark.parametrize(("attempt", "max_attempts"), [(3, 3), (1, 1), (4, 3)])
def test_failure_at_max_attempts_is_dead(attempt: int, max_attempts: int) -> None:
    decision = decide_failure(
        attempt=attempt,
        max_attempts=max_attempts,
        policy=RetryPolicy(),
        now=NOW,
        rng=random.Random(0),
    )

    assert decision.dead
    assert decision.run_at == NOW


def test_a_requested_retry_time_replaces_the_back_off() -> None:
    wanted = NOW + timedelta(hours=2)

    decision = decide_failure(
        attempt=1,
        max_attempts=3,
        policy=RetryPolicy(base=5.0),
        now=NOW,
        rng=random.Random(0),
        retry_at=wanted,
    )

    assert decision == type(decision)(dead=False, run_at=wanted)


def test_a_requested_retry_time_in_the_past_means_now() -> None:
    decision = decide_failure(
        attempt=1,
        max_attempts=3,
        policy=RetryPolicy(),
        now=NOW,
        rng=random.Random(0),
        retry_at=NOW - timedelta(days=1),
    )

    assert decision.run_at == NOW


def test_a_requested_retry_on_the_last_attempt_is_still_dead() -> None:
    decision = decide_failure(
        attempt=3,
        max_attempts=3,
        policy=RetryPolicy(),
        now=NOW,
        rng=random.Random(0),
        retry_at=NOW + timedelta(minutes=5),
    )

    assert decision.dead


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        (None, None),
        (90, NOW + timedelta(seconds=90)),
        (2.5, NOW + timedelta(seconds=2.5)),
        (timedelta(minutes=3), NOW + timedelta(minutes=3)),
        (NOW + timedelta(days=1), NOW + timedelta(days=1)),
    ],
)
def test_retry_after_accepts_seconds_timedelta_or_datetime(
    after: float | timedelta | datetime | None, expected: datetime | None
) -> None:
    assert retry_at_from(after, NOW) == expected


def test_retry_exception_keeps_its_request() -> None:
    retry = skiplock.Retry(after=timedelta(seconds=5), reason="rate limited")

    assert retry.after == timedelta(seconds=5)
    assert retry.reason == "rate limited"
    assert str(retry) == "rate limited"


@pytest.mark.parametrize(
    ("after", "delay"),
    [(45, 45.0), (timedelta(minutes=2), 120.0), (NOW + timedelta(hours=1), 3600.0)],
)
def test_a_handler_retry_becomes_an_outcome_with_that_delay(
    after: float | timedelta | datetime, delay: float
) -> None:
    outcome = failure_outcome(
        7, 1, 3, RetryPolicy(), skiplock.Retry(after=after), NOW, random.Random(0)
    )

    assert (outcome.job_id, outcome.attempt, outcome.dead, outcome.delay) == (7, 1, False, delay)
    assert outcome.error is not None
    assert outcome.error["type"] == "Retry"


def test_a_failure_outcome_stores_type_message_and_traceback() -> None:
    def handler() -> None:
        raise ValueError("card declined")

    try:
        handler()
    except ValueError as exc:
        outcome = failure_outcome(7, 2, 2, RetryPolicy(), exc, NOW, random.Random(0))

    assert outcome.dead
    assert outcome.error is not None
    assert outcome.error["attempt"] == 2
    assert outcome.error["type"] == "ValueError"
    assert outcome.error["message"] == "card declined"
    assert outcome.error["at"] == NOW.isoformat()
    assert "in handler" in outcome.error["traceback"]
    assert "ValueError: card declined" in outcome.error["traceback"]


def test_a_naive_datetime_is_refused_where_it_is_given() -> None:
    # Comparing it with the aware clock later would fail after the handler's error was
    # caught, leaving the job running until its lease expired; refuse it at once instead.
    naive = datetime(2030, 1, 1, 13, 0)

    with pytest.raises(ValueError, match="naive datetime"):
        skiplock.Retry(after=naive)
    with pytest.raises(ValueError, match="naive datetime"):
        skiplock.Snooze(after=naive)
