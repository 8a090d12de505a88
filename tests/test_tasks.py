"""Task definitions fail at definition time; arguments are checked before anything is written.

Pure: an App does not connect until something needs the database, so none is used here.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import skiplock
from skiplock.tasks import encode_args

UNUSED_URL = "postgresql://nobody@127.0.0.1:1/never-connected"


@pytest.fixture
def offline_app() -> skiplock.App:
    """An App that never connects: definitions and argument checks need no database."""
    return skiplock.App(UNUSED_URL, schema="skiplock")


def send_receipt(order_id: int, copies: int = 1) -> str:
    return f"receipt {order_id} x{copies}"


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("max_attemps", "max_attempts"),
        ("prority", "priority"),
        ("queu", "queue"),
        ("transactionl", "transactional"),
        ("timout", "timeout"),
        ("retries", "retry"),
    ],
)
def test_a_misspelt_task_option_fails_at_definition_and_names_the_right_one(
    offline_app: skiplock.App, typo: str, suggestion: str
) -> None:
    with pytest.raises(skiplock.ConfigurationError) as caught:
        offline_app.task(**{typo: 1})

    assert f"unknown task option {typo!r}" in str(caught.value)
    assert f"did you mean {suggestion!r}" in str(caught.value)
    assert offline_app.tasks == {}


def test_an_unknown_task_option_without_a_near_name_lists_the_known_ones(
    offline_app: skiplock.App,
) -> None:
    with pytest.raises(skiplock.ConfigurationError, match=r"known: name, queue, priority"):
        offline_app.task(colour="blue")


def test_a_misspelt_enqueue_option_names_the_right_one(offline_app: skiplock.App) -> None:
    task = offline_app.task(send_receipt)

    with pytest.raises(skiplock.ConfigurationError, match="did you mean 'priority'"):
        task.with_options(prioirty=1)


@pytest.mark.parametrize(
    "queue", ["", "has space", "slash/queue", "x" * 129, "émoji", "new\nline", 7, None]
)
def test_a_bad_queue_name_is_refused_at_definition_and_per_call(
    offline_app: skiplock.App, queue: object
) -> None:
    with pytest.raises(skiplock.ConfigurationError, match="queue name"):
        offline_app.task(queue=queue)
    task = offline_app.task(send_receipt)
    with pytest.raises(skiplock.ConfigurationError, match="queue name"):
        task.with_options(queue=queue)


def test_a_transactional_task_cannot_be_sent_to_another_queue(offline_app: skiplock.App) -> None:
    """Workers hold transactional sessions for the queue each transactional task names:
    a job of it on another queue would wait there forever, so the call is refused."""

    @offline_app.task(name="post_entry", queue="ledger", transactional=True)
    def post_entry(conn: Any, n: int) -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match=r"post_entry.*'ledger'.*'audit'"):
        post_entry.with_options(queue="audit")
    assert post_entry.with_options(queue="ledger", priority=3).job(n=1).queue == "ledger"


@pytest.mark.parametrize("queue", ["default", "emails", "a.b:c-d_e", "Q" * 128])
def test_good_queue_names_are_accepted(offline_app: skiplock.App, queue: str) -> None:
    task = offline_app.task(queue=queue)(send_receipt)

    assert task.job(order_id=1).queue == queue


@pytest.mark.parametrize("priority", [1.5, True, "1", None, 32768, -32769])
def test_a_bad_priority_is_refused_at_definition_and_per_call(
    offline_app: skiplock.App, priority: object
) -> None:
    with pytest.raises(skiplock.ConfigurationError, match="priority must be"):
        offline_app.task(priority=priority)
    task = offline_app.task(send_receipt)
    with pytest.raises(skiplock.ConfigurationError, match="priority must be"):
        task.with_options(priority=priority)


@pytest.mark.parametrize("max_attempts", [0, -1, True, 2.0, "3"])
def test_bad_max_attempts_are_refused(offline_app: skiplock.App, max_attempts: object) -> None:
    with pytest.raises(skiplock.ConfigurationError, match="max_attempts must be"):
        offline_app.task(max_attempts=max_attempts)
    task = offline_app.task(send_receipt)
    with pytest.raises(skiplock.ConfigurationError, match="max_attempts must be"):
        task.with_options(max_attempts=max_attempts)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retry": {"base": 1}}, "retry must be a skiplock.RetryPolicy"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"timeout": -5}, "timeout must be a positive number"),
        ({"timeout": "5"}, "timeout must be a positive number"),
        ({"name": "has space"}, "task name"),
        ({"name": ""}, "task name"),
        ({"name": "t" * 256}, "task name"),
    ],
)
def test_other_bad_task_options_are_refused(
    offline_app: skiplock.App, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(skiplock.ConfigurationError, match=message):
        offline_app.task(**options)


def test_a_transactional_task_must_take_the_connection_first(offline_app: skiplock.App) -> None:
    def no_conn(*, order_id: int) -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="connection as its first"):
        offline_app.task(name="no_conn", transactional=True)(no_conn)


def test_a_handler_whose_parameters_cannot_be_passed_by_name_is_refused(
    offline_app: skiplock.App,
) -> None:
    def positional_only(order_id: int, /) -> None: ...

    def star_args(*order_ids: int) -> None: ...

    for handler in (positional_only, star_args):
        with pytest.raises(skiplock.ConfigurationError, match="cannot be passed by keyword"):
            offline_app.task(name=handler.__name__)(handler)


def test_a_task_name_is_registered_once(offline_app: skiplock.App) -> None:
    offline_app.task(name="receipts.send")(send_receipt)

    with pytest.raises(skiplock.ConfigurationError, match="already registered"):
        offline_app.task(name="receipts.send")(send_receipt)


def test_the_default_name_is_module_and_qualified_name(offline_app: skiplock.App) -> None:
    task = offline_app.task(send_receipt)

    assert task.name == f"{__name__}.send_receipt"
    assert offline_app.get_task(task.name) is task


def test_a_nested_handler_without_a_name_is_told_to_pass_one(offline_app: skiplock.App) -> None:
    def nested(order_id: int) -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="name="):
        offline_app.task(nested)


def test_an_unregistered_name_raises_unknown_task(offline_app: skiplock.App) -> None:
    with pytest.raises(skiplock.UnknownTaskError, match="'nope'"):
        offline_app.get_task("nope")


def test_a_task_of_a_script_run_directly_is_explained(offline_app: skiplock.App) -> None:
    """`python enqueue.py` names its tasks __main__.*; the worker imported the module."""
    with pytest.raises(skiplock.UnknownTaskError, match=r"enqueued by a script run directly"):
        offline_app.get_task("__main__.fetch")


def test_calling_a_task_runs_the_handler_inline(offline_app: skiplock.App) -> None:
    task = offline_app.task(send_receipt)

    assert task(5, copies=2) == "receipt 5 x2"


def test_a_job_spec_carries_the_task_defaults(offline_app: skiplock.App) -> None:
    task = offline_app.task(queue="emails", priority=3, max_attempts=7)(send_receipt)

    spec = task.job(order_id=1)

    assert spec == skiplock.JobSpec(
        task=task.name,
        args_json='{"order_id":1}',
        queue="emails",
        priority=3,
        max_attempts=7,
        run_at=None,
        delay=0.0,
    )


def test_per_call_options_override_the_defaults(offline_app: skiplock.App) -> None:
    task = offline_app.task(queue="emails", priority=3, max_attempts=7)(send_receipt)
    when = datetime(2031, 5, 4, 3, 2, 1, tzinfo=UTC)

    spec = task.with_options(queue="urgent", priority=0, max_attempts=1, run_at=when).job(
        order_id=1
    )

    assert (spec.queue, spec.priority, spec.max_attempts, spec.run_at, spec.delay) == (
        "urgent",
        0,
        1,
        when,
        0.0,
    )


@pytest.mark.parametrize(
    "when", [datetime(2031, 1, 1), datetime.now(), "2031-01-01T00:00:00Z", 1_900_000_000]
)
def test_run_at_must_be_an_aware_datetime(offline_app: skiplock.App, when: object) -> None:
    task = offline_app.task(send_receipt)

    with pytest.raises(skiplock.ConfigurationError, match="timezone-aware datetime"):
        task.with_options(run_at=when)


@pytest.mark.parametrize("delay", [-1, math.nan, math.inf, True, "5", timedelta(seconds=5)])
def test_delay_must_be_a_finite_number_of_seconds(offline_app: skiplock.App, delay: object) -> None:
    task = offline_app.task(send_receipt)

    with pytest.raises(skiplock.ConfigurationError, match="delay must be"):
        task.with_options(delay=delay)


def test_run_at_and_delay_are_exclusive(offline_app: skiplock.App) -> None:
    task = offline_app.task(send_receipt)

    with pytest.raises(skiplock.ConfigurationError, match="run_at or delay, not both"):
        task.with_options(run_at=datetime.now(UTC), delay=5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "missing a required argument: 'order_id'"),
        ({"order_id": 1, "colour": "red"}, "unexpected keyword argument 'colour'"),
        ({"copies": 2}, "missing a required argument: 'order_id'"),
    ],
)
def test_arguments_that_do_not_fit_the_handler_are_refused(
    offline_app: skiplock.App, args: dict[str, Any], message: str
) -> None:
    task = offline_app.task(send_receipt)

    with pytest.raises(skiplock.EnqueueError, match=message):
        task.job(**args)


def test_a_transactional_task_is_checked_without_its_connection(offline_app: skiplock.App) -> None:
    def record(conn: object, order_id: int) -> None: ...

    task = offline_app.task(name="record", transactional=True)(record)

    assert json.loads(task.job(order_id=3).args_json) == {"order_id": 3}
    with pytest.raises(skiplock.EnqueueError, match="missing a required argument: 'order_id'"):
        task.job()


class Order:
    pass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (Order(), "argument 'value' is an Order, which is not JSON"),
        ({1, 2}, "argument 'value' is a set"),
        (datetime(2030, 1, 1, tzinfo=UTC), "argument 'value' is a datetime"),
        (b"bytes", "argument 'value' is a bytes"),
        (math.nan, "argument 'value' is nan, which JSON cannot hold"),
        (math.inf, "argument 'value' is inf"),
        (-math.inf, "argument 'value' is -inf"),
        ("a\x00b", "argument 'value' contains a NUL character"),
        ("\ud800", "argument 'value' contains a lone surrogate"),
        ({"ok": [1, {"deep": {3}}]}, r"argument 'value'\['ok'\]\[1\]\['deep'\] is a set"),
        ({1: "x"}, "argument 'value' has a non-string key 1"),
        ({"k\x00": 1}, "key 'k\\\\x00' contains a NUL character"),
    ],
)
def test_values_json_cannot_hold_are_refused_naming_the_argument(
    value: object, message: str
) -> None:
    with pytest.raises(skiplock.EnqueueError, match=message):
        encode_args("send_receipt", {"value": value})


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(value=json_values)
def test_any_json_value_without_nul_or_surrogates_encodes_and_decodes_equal(
    value: object,
) -> None:
    def storable(v: object) -> bool:
        if isinstance(v, str):
            return "\x00" not in v and not any(0xD800 <= ord(c) <= 0xDFFF for c in v)
        if isinstance(v, list):
            return all(storable(item) for item in v)
        if isinstance(v, dict):
            return all(storable(k) and storable(item) for k, item in v.items())
        return True

    if storable(value):
        assert json.loads(encode_args("t", {"value": value})) == {"value": value}
    else:
        with pytest.raises(skiplock.EnqueueError):
            encode_args("t", {"value": value})
