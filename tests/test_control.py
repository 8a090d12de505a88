"""Parsing notification payloads (skiplock.control): no database.

Any role that can connect can NOTIFY on skiplock's channels, so the parser meets every
string there is: it must never raise, must return exactly the messages skiplock's own
statements send, and None for anything else.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skiplock.control import (
    AdmitRequest,
    CancelRequest,
    Channel,
    LimitsChanged,
    ResultsReady,
    Throttle,
    Wakeup,
    describe_payload,
    parse,
    parse_control,
    parse_results,
    parse_wakeup,
)

pytestmark = pytest.mark.timeout(60)

# Strings near the real payloads: their pieces, shuffled and joined by tabs, with odd ones.
PIECES = [
    "",
    "default",
    "cancel",
    "admit",
    "limits",
    "0",
    "-1",
    "42",
    "²",
    "\u0661\u0662",
    "NaN",
    "nan",
    "inf",
    "Infinity",
    "-Infinity",
    "1e400",
    "1733050000.123456",
    "99999999999999999999",
    "9223372036854775808",
    " 1",
    "1_0",
    "\u202e",
    "\ufeff",
    "👩\u200d👩\u200d👧",
    "q" * 129,
    "k" * 256,
]
near_payloads = st.lists(st.sampled_from(PIECES), max_size=5).map("\t".join)
payloads = st.text() | near_payloads | st.text(alphabet="0123456789\t.-e", max_size=40)


@given(payload=payloads, channel=st.sampled_from(list(Channel)))
def test_no_payload_on_any_channel_raises(payload: str, channel: Channel) -> None:
    message = parse(channel, payload)
    assert message is None or isinstance(
        message, (Wakeup, CancelRequest, AdmitRequest, LimitsChanged, ResultsReady)
    )


@given(payload=payloads)
def test_every_wakeup_is_one_a_row_could_send(payload: str) -> None:
    wakeup = parse_wakeup(payload)
    if wakeup is None:
        return
    assert 1 <= len(wakeup.queue) <= 128
    assert (wakeup.priority is None) == (wakeup.run_at is None)
    if wakeup.priority is not None:
        assert -32768 <= wakeup.priority <= 32767


@given(payload=payloads)
def test_every_cancel_names_a_bigint_id(payload: str) -> None:
    message = parse_control(payload)
    if isinstance(message, CancelRequest):
        assert 1 <= message.job_id <= 2**63 - 1
        assert payload == f"cancel\t{message.job_id}"


@given(
    queue=st.text(min_size=1, max_size=128).filter(lambda q: "\t" not in q),
    priority=st.integers(-32768, 32767),
    at=st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9998, 1, 1)),
)
def test_the_trigger_payload_round_trips(queue: str, priority: int, at: datetime) -> None:
    at = at.replace(tzinfo=UTC)
    epoch = f"{at.timestamp():.6f}"

    wakeup = parse_wakeup(f"{queue}\t{priority}\t{epoch}")

    assert wakeup is not None
    assert (wakeup.queue, wakeup.priority) == (queue, priority)
    assert wakeup.run_at is not None
    assert abs((wakeup.run_at - at).total_seconds()) < 0.001


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ("default", Wakeup("default")),
        ("default\t0\t0", Wakeup("default", 0, datetime(1970, 1, 1, tzinfo=UTC))),
        ("default\t-5\t1.5e9", Wakeup("default", -5, datetime.fromtimestamp(1.5e9, UTC))),
        # A queue name may hold tabs (a row written by hand): the hints are the last two.
        ("a\tb\t3\t0", Wakeup("a\tb", 3, datetime(1970, 1, 1, tzinfo=UTC))),
        # A run_at no datetime holds still wakes the queue.
        ("default\t0\tInfinity", Wakeup("default")),
        ("default\t0\t-Infinity", Wakeup("default")),
        ("default\t0\t1e300", Wakeup("default")),
        ("default\t0\t-99999999999999", Wakeup("default")),
        ("\u202egnp.exe", Wakeup("\u202egnp.exe")),
    ],
)
def test_wakeups_skiplock_sends(payload: str, expected: Wakeup) -> None:
    assert parse(Channel.JOBS, payload) == expected


@pytest.mark.parametrize(
    "payload",
    [
        "",
        "q" * 129,
        "x" * 7999,
        "default\t",
        "default\t0",
        "default\t\t",
        "\t0\t0",
        "default\tx\t0",
        "default\t1.5\t0",
        "default\t²\t0",
        "default\t\u0661\u0662\t0",
        "default\t40000\t0",
        "default\t99999999999999999999\t0",
        "default\t0\tNaN",
        "default\t0\tnan",
        "default\t0\tinf",
        "default\t0\tinfinity",
        "default\t0\t",
        "default\t0\t1_000",
        "default\t0\t 1",
        "default\t0\t\u0661\u0662",
        "default\t0\t" + "9" * 400,
    ],
)
def test_malformed_wakeups_are_none(payload: str) -> None:
    assert parse(Channel.JOBS, payload) is None


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ("cancel\t1", CancelRequest(1)),
        ("cancel\t9223372036854775807", CancelRequest(2**63 - 1)),
        ("admit", AdmitRequest(None)),
        ("admit\tcustomer:7", AdmitRequest("customer:7")),
        ("admit\ta\tb", AdmitRequest("a\tb")),
        ("admit\t" + "k" * 255, AdmitRequest("k" * 255)),
        ("limits", LimitsChanged()),
    ],
)
def test_control_messages_skiplock_sends(payload: str, expected: object) -> None:
    assert parse(Channel.CONTROL, payload) == expected


@pytest.mark.parametrize(
    "payload",
    [
        "",
        "cancel",
        "cancel\t",
        "cancel\t²",  # '²'.isdigit() is True, and int('²') raises
        "cancel\t\u0661\u0662",
        "cancel\t0",
        "cancel\t-1",
        "cancel\t007",
        "cancel\t+1",
        "cancel\t 1",
        "cancel\t1 ",
        "cancel\t9223372036854775808",
        "cancel\t99999999999999999999999",
        "cancel\t1\t2",
        "admit\t",
        "admit\t" + "k" * 256,
        "limits\t",
        "limits\tqueue",
        "Limits",
        "stop",
        "x" * 7999,
    ],
)
def test_malformed_control_messages_are_none(payload: str) -> None:
    assert parse(Channel.CONTROL, payload) is None


def test_results_are_the_empty_payload_only() -> None:
    assert parse_results("") == ResultsReady()
    assert parse(Channel.RESULTS, "done") is None


def test_a_long_payload_is_described_short() -> None:
    assert describe_payload("cancel\t²") == "'cancel\\t²'"
    described = describe_payload("x" * 7999)
    assert described.endswith("(7999 characters)")
    assert len(described) < 120


def test_the_throttle_lets_one_line_per_key_per_interval_and_counts_the_rest() -> None:
    throttle = Throttle(every=10.0)

    assert throttle.allow("a", 100.0) == 0
    assert throttle.allow("a", 101.0) is None
    assert throttle.allow("a", 109.9) is None
    assert throttle.allow("b", 105.0) == 0  # each key on its own
    assert throttle.allow("a", 110.0) == 2
    assert throttle.allow("a", 115.0) is None
    assert throttle.allow("a", 130.0) == 1
    assert throttle.allow("a", 140.0) == 0


@given(times=st.lists(st.floats(0, 1000), max_size=200).map(sorted))
def test_the_throttle_writes_at_most_one_line_per_interval_and_loses_no_count(
    times: list[float],
) -> None:
    throttle = Throttle(every=10.0)
    written: list[float] = []
    last_written = -1
    reported = 0
    for index, now in enumerate(times):
        held = throttle.allow("c", now)
        if held is not None:
            written.append(now)
            last_written = index
            reported += held + 1
    assert all(later - earlier >= 10.0 for earlier, later in itertools.pairwise(written))
    # Every event up to the last line written is that line or counted in one.
    assert reported == last_written + 1
