"""Bulk enqueue writes COPY text itself and builds jobs from a per-call template: the
rows must still say exactly what the jobs say, whatever their text holds."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import skiplock
from skiplock.client import COPY_CHUNK_ROWS
from skiplock.errors import EnqueueError
from skiplock.tasks import _encode_args_walked, encode_args

pytestmark = pytest.mark.server_version

# -- the fast argument check agrees with the full walk ----------------------------------

awkward_text = st.text() | st.sampled_from(
    ["a\x00b", "\udcff", "x\ud800", "😀", "é", "1e+5", "{", "\\u0000", "\\ud800", "\t\n\r\\"]
)
awkward_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from([1e16, 1e23, -2.5e300, math.nan, -math.inf])
    | st.builds(pow, st.just(10), st.just(5000))  # past Python's int-to-str limit
    | awkward_text
    | st.sampled_from([{1, 2}, datetime(2030, 1, 1, tzinfo=UTC), b"bytes"])
)
awkward_keys = awkward_text | st.integers() | st.none() | st.booleans()
awkward_values = st.recursive(
    awkward_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(awkward_keys, children, max_size=4)
    ),
    max_leaves=20,
)


def outcome(encode: Any, args: dict[str, Any]) -> tuple[str, str]:
    try:
        return "encoded", encode("store", args)
    except EnqueueError as exc:
        return "refused", str(exc)


@settings(max_examples=400, deadline=None)
@given(args=st.dictionaries(awkward_text, awkward_values, max_size=4))
@example(args={"value": {1: 2}})  # a nested key the encoder would turn into "1"
@example(args={"value": [{None: 1}]})
@example(args={"value": "a\x00b"})
@example(args={"value": {"k": "\udcff"}})
@example(args={"value": [1.0, 1e23]})
@example(args={"value": math.inf})
@example(args={"value": "😀 é"})
def test_encoding_arguments_agrees_with_the_full_walk(args: dict[str, Any]) -> None:
    assert outcome(encode_args, args) == outcome(_encode_args_walked, args)


# -- jobs built from a call's shared fields ---------------------------------------------


def test_jobs_of_one_call_are_separate_frozen_values() -> None:
    app = skiplock.App(schema="skiplock")
    send = app.task(name="send", queue="emails", priority=2)(lambda n: None)
    once = app.task(name="once", unique=True, unique_window=60)(lambda n: None)

    first, second = send.job(n=1), send.job(n=2)
    keyed_first, keyed_second = once.job(n=1), once.job(n=2)

    assert first == skiplock.JobSpec(
        task="send", args_json='{"n":1}', queue="emails", priority=2, max_attempts=3
    )
    assert second.args_json == '{"n":2}'
    assert (keyed_first.unique_key, keyed_second.unique_key) == ('once:{"n":1}', 'once:{"n":2}')
    assert keyed_first.unique_window == 60.0
    assert hash(first) == hash(dataclasses.replace(second, args_json='{"n":1}'))
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.args_json = "{}"  # type: ignore[misc]


def test_a_window_without_a_key_is_refused_for_every_job() -> None:
    app = skiplock.App(schema="skiplock")
    send = app.task(name="send")(lambda n: None)
    call = send.with_options(unique_window=60)

    for n in range(2):
        with pytest.raises(skiplock.ConfigurationError, match="unique_window needs a unique_key"):
            call.job(n=n)


# -- COPY text ---------------------------------------------------------------------------


def test_text_that_looks_like_copy_syntax_is_stored_as_given(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    task = app.task(name="store")(lambda value: None)
    awkward = "tab\there\nnew line\r\\N \\. \\\\ end"
    made_by_hand = skiplock.JobSpec(
        task="store",
        args_json='{\n\t"value":\r "a\\\\b" }',  # JSON whitespace: tab, line breaks
        queue="odd\tqueue\\name",
        priority=0,
        max_attempts=3,
        ordering_key="key\t\\N\n",
    )
    specs = [task.job(value=awkward), task.job(value={awkward: [awkward]}), made_by_hand]

    ids = app.enqueue_many(conn, specs)

    rows = conn.execute(
        "SELECT id, args, queue, ordering_key FROM skiplock.jobs ORDER BY id"
    ).fetchall()
    assert [row[0] for row in rows] == ids
    assert [row[1:] for row in rows] == [
        ({"value": awkward}, "default", None),
        ({"value": {awkward: [awkward]}}, "default", None),
        ({"value": "a\\b"}, "odd\tqueue\\name", "key\t\\N\n"),
    ]


storable_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"))
storable_floats = st.floats(allow_nan=False, allow_infinity=False)
storable_values = st.recursive(
    st.none() | st.booleans() | st.integers() | storable_floats | storable_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(storable_text, children, max_size=4)
    ),
    max_leaves=25,
)
bulk_app = skiplock.App(schema="skiplock")
store = bulk_app.task(name="store")(lambda value: None)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=st.lists(storable_values, min_size=1, max_size=8))
def test_any_json_values_come_back_equal_from_a_bulk_enqueue(
    conn: psycopg.Connection[Any], values: list[object]
) -> None:
    with conn.transaction(force_rollback=True):
        ids = bulk_app.enqueue_many(conn, [store.job(value=value) for value in values])
        rows = conn.execute(
            "SELECT args FROM skiplock.jobs WHERE id = ANY(%s) ORDER BY id", (ids,)
        ).fetchall()

    assert [row[0]["value"] for row in rows] == values


def test_every_job_keeps_its_id_queue_and_due_time_across_chunks(
    app: skiplock.App, conn: psycopg.Connection[Any]
) -> None:
    send = app.task(name="send")(lambda n: None)
    at = datetime(2035, 1, 1, tzinfo=ZoneInfo("Asia/Kolkata"))  # a half-hour offset
    calls = [
        send.with_options(),
        send.with_options(queue="sms", priority=-1),
        send.with_options(delay=90),
        send.with_options(run_at=at),
        send.with_options(ordering_key="k", delay=30),
    ]
    count = 2 * COPY_CHUNK_ROWS + 7
    specs = [calls[n % len(calls)].job(n=n) for n in range(count)]

    ids = app.enqueue_many(conn, specs)

    rows = conn.execute(
        "SELECT id, args, queue, priority, state, run_at, run_at - created_at "
        "FROM skiplock.jobs ORDER BY id"
    ).fetchall()
    assert [row[0] for row in rows] == ids
    assert [row[1] for row in rows] == [{"n": n} for n in range(count)]
    expected = [
        ("default", 0, "available", timedelta(0)),
        ("sms", -1, "available", timedelta(0)),
        ("default", 0, "scheduled", timedelta(seconds=90)),
        ("default", 0, "scheduled", None),
        ("default", 0, "blocked", timedelta(seconds=30)),
    ]
    for n, (_, _, queue, priority, state, run_at, after) in enumerate(rows):
        want_queue, want_priority, want_state, want_after = expected[n % len(calls)]
        assert (queue, priority, state) == (want_queue, want_priority, want_state)
        assert after == want_after if want_after is not None else run_at == at


def next_offset_change(zone: ZoneInfo) -> int:
    """Whole days from now until just past the zone's next change of UTC offset."""
    now = datetime.now(zone)
    for days in range(1, 400):
        if (now + timedelta(days=days)).utcoffset() != now.utcoffset():
            return days + 1
    raise AssertionError(f"{zone} has no offset change within a year")


def test_a_delay_is_elapsed_time_in_a_session_with_daylight_saving(
    app: skiplock.App, database_url: str
) -> None:
    zone = "America/New_York"
    delay = next_offset_change(ZoneInfo(zone)) * 86400.0
    send = app.task(name="send")(lambda n: None)

    with psycopg.connect(database_url, options=f"-c TimeZone={zone}") as conn:
        [bulk_id] = app.enqueue_many(conn, [send.with_options(delay=delay).job(n=1)])
        single_id = send.with_options(delay=delay).enqueue(conn, n=2)
        rows = conn.execute(
            "SELECT id, run_at - created_at FROM skiplock.jobs ORDER BY id"
        ).fetchall()
        conn.rollback()

    assert rows == [(bulk_id, timedelta(seconds=delay)), (single_id, timedelta(seconds=delay))]
