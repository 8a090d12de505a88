"""skiplock.storable, without a database: what PostgreSQL would refuse is found before the
write, said where, and text is made storable without losing what it showed.

PostgreSQL's rules, as checked here: text and jsonb hold no NUL and no lone surrogate
(a Python str can hold both); JSON has no inf or nan; numeric has at most 131,072 digits
before the point.
"""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import skiplock
from skiplock.completer import refused_error, storable_outcome
from skiplock.errors import ResultNotStorableError
from skiplock.executor import error_record, failure_outcome, requested_time
from skiplock.outcomes import Completed, Retried, Snoozed
from skiplock.retry import RetryPolicy
from skiplock.storable import (
    encode_result,
    problem_in,
    storable_error,
    storable_json_text,
    storable_message,
    storable_text,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def postgres_accepts_text(text: str) -> bool:
    """PostgreSQL's own rule for text (UTF-8 server encoding): no NUL, valid UTF-8."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


any_text = st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4)
    ),
    max_leaves=12,
)


@given(any_text)
def test_storable_text_is_always_accepted_and_leaves_good_text_alone(text: str) -> None:
    stored = storable_text(text)
    assert postgres_accepts_text(stored)
    if postgres_accepts_text(text):
        assert stored == text


def test_storable_text_shows_what_it_replaced() -> None:
    assert storable_text("a\x00b\ud800c") == "a\\x00b\\ud800c"


@given(json_values)
def test_encode_result_returns_storable_json_or_says_why_not(value: Any) -> None:
    try:
        text = encode_result(value)
    except ResultNotStorableError as refused:
        assert str(refused).startswith("result not storable: ")
        assert problem_in(value) is not None
        return
    assert problem_in(value) is None
    if value is None:
        assert text is None
        return
    assert text is not None and postgres_accepts_text(text)
    assert "\\u0000" not in text.replace("\\\\", "")
    assert json.loads(text) == value or _has_nan(value)


def _has_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("a\x00", "the string at $ contains a NUL"),
        ({"k": ["ok", "\ud800"]}, "the string at $.k[1] contains a lone surrogate"),
        ([1.0, math.inf], "the number at $[1] is inf"),
        ({"n": math.nan}, "the number at $.n is nan"),
        ({"bad\x00key": 1}, "a key at $ contains a NUL"),
        (10**5000, "the integer at $ has more digits"),
    ],
    ids=["nul", "surrogate", "inf", "nan", "key", "int"],
)
def test_encode_result_names_the_problem_and_where(value: Any, where: str) -> None:
    with pytest.raises(ResultNotStorableError, match=r"^result not storable: ") as refused:
        encode_result(value)
    assert where in str(refused.value)


def test_an_int_past_numeric_is_refused_even_when_python_prints_it() -> None:
    import sys  # noqa: PLC0415

    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(ResultNotStorableError, match="more digits"):
            encode_result(10**140_000)
        assert encode_result(10**4000) == "1" + "0" * 4000
    finally:
        sys.set_int_max_str_digits(old)


def test_a_value_json_has_no_form_for_is_kept_as_its_storable_repr() -> None:
    assert json.loads(encode_result({1, 2}) or "") == {"repr": "{1, 2}"}

    class Odd:
        def __repr__(self) -> str:
            return "odd\x00\ud800"

    assert json.loads(encode_result(Odd()) or "") == {"repr": "odd\\x00\\ud800"}


def test_a_value_nested_too_deeply_is_refused() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ResultNotStorableError, match="nested too deeply"):
        encode_result(deep)


@pytest.mark.parametrize(
    ("text", "storable"),
    [
        (None, True),
        ('{"done": 1}', True),
        ('"caf\\u00e9"', True),
        ('"\\ud83d\\ude00"', True),  # an escaped pair is a character
        ('"\\u0000"', False),
        ('"\\ud800"', False),
        ('"\\\\u0000"', True),  # a backslash, then "u0000": not a NUL
    ],
)
def test_storable_json_text(text: str | None, storable: bool) -> None:
    assert storable_json_text(text) is storable


def test_error_records_are_storable_whatever_the_exception_holds() -> None:
    class Unprintable(Exception):  # noqa: N818
        def __str__(self) -> str:
            raise RuntimeError("no")

    for exc in (ValueError("a\x00b"), KeyError("\ud800"), Unprintable()):
        try:
            raise exc
        except Exception as caught:
            record = error_record(caught, 1, NOW)
        for value in record.values():
            assert not isinstance(value, str) or postgres_accepts_text(value)
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    assert storable_message(Unprintable()).endswith("Unprintable: str() raised RuntimeError>")


def test_storable_outcome_cleans_the_error_and_drops_refused_progress() -> None:
    outcome = Retried(
        1, 1, error={"attempt": 1, "message": "x\x00", "n": 3}, progress_json='"\\u0000"'
    )
    clean = storable_outcome(outcome)
    assert clean.error == {"attempt": 1, "message": "x\\x00", "n": 3}
    assert clean.progress_json is None
    fine = Completed(2, 1, result_json="1", progress_json='{"done": 2}')
    assert storable_outcome(fine) is fine
    assert storable_error({"a": "ok"}) == {"a": "ok"}


def test_a_refused_completion_is_recorded_as_result_not_storable() -> None:
    error = refused_error(Completed(1, 2, result_json='"x"'), ValueError("bad\x00"), "now")
    assert error["message"] == "result not storable: bad\\x00"
    assert (error["attempt"], error["type"]) == (2, "OutcomeNotStorableError")
    failed = refused_error(Retried(1, 2, error={}), ValueError("no"), "now")
    assert failed["message"] == "outcome not storable: no"


IMPOSSIBLE = [
    math.inf,
    -math.inf,
    math.nan,
    1e300,
    timedelta.max,
    datetime(9999, 12, 31, tzinfo=UTC),
    "soon",
    NOW + timedelta(days=200 * 365),
]


@pytest.mark.parametrize("after", IMPOSSIBLE, ids=repr)
def test_an_impossible_retry_time_is_a_recorded_failure_with_the_policy_back_off(
    after: Any,
) -> None:
    exc = skiplock.Retry.__new__(skiplock.Retry)
    Exception.__init__(exc, "retry requested")
    exc.after, exc.reason = after, ""
    policy = RetryPolicy(base=10, cap=10, jitter=0)
    outcome = failure_outcome(7, 1, 3, policy, exc, NOW, random.Random(0))
    assert outcome.error is not None
    assert outcome.error["type"] == "OutcomeNotStorableError"
    assert outcome.error["message"].startswith("Retry(after=")
    assert (outcome.dead, outcome.delay) == (False, 10.0)
    assert json.dumps(outcome.error)


@pytest.mark.parametrize("after", IMPOSSIBLE, ids=repr)
def test_an_impossible_snooze_time_fails_the_attempt(after: Any) -> None:
    exc = skiplock.Snooze.__new__(skiplock.Snooze)
    Exception.__init__(exc, "snoozed")
    exc.after = after
    outcome = failure_outcome(7, 3, 3, RetryPolicy(), exc, NOW, random.Random(0))
    assert (isinstance(outcome, Snoozed), outcome.dead) == (False, True)
    assert outcome.error is not None and outcome.error["message"].startswith("Snooze(after=")


@given(st.floats(min_value=-1e9, max_value=86400 * 365 * 50))
def test_a_possible_retry_time_is_kept(seconds: float) -> None:
    at = requested_time(seconds, NOW, "Retry")
    assert abs((at - NOW).total_seconds() - seconds) < 1e-3
