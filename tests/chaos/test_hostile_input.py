"""Hostile input: arguments, options, names and hand-written rows that are wrong on purpose.

Through the client, each one either goes in and comes back equal, or is refused at once
with an EnqueueError or ConfigurationError that names the problem, with nothing written
and the caller's transaction still usable. Rows that only SQL can write (arguments that do
not fit the handler, ``'{}'`` for a task that needs arguments, unknown task names) become
failed jobs with their error stored, while a real worker process stays alive and other
jobs still complete. The plain SQL path refuses non-object arguments by the table's CHECK
constraint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

import skiplock
from conftest import wait_until
from skiplock.tasks import MAX_ARGS_BYTES

from .chaos_app import HOSTILE_QUEUE, app, echo, strict
from .conftest import SCHEMA, ChaosDatabase, Fleet

pytestmark = [pytest.mark.server_version, pytest.mark.chaos]

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
STEP_TIMEOUT = 30.0
POLL = 0.05

SQL_LOOKING = [
    "'); DROP TABLE skiplock.jobs; --",
    "x' OR '1'='1",
    "$$; SELECT pg_sleep(60); $$",
    "%(queue)s",
    "%s",
    "{jobs}",
    "E'\\\\x00'",
    "\\N",
    "\\.",
    "a\tb\nc\r",
    "\\",
    "/* */ --",
    "pg_notify('skiplock.jobs', 'x')",
]
ODD_UNICODE = [
    "\u202egnp.exe",  # right-to-left override
    "\u200d\u200b\ufeff",  # zero-width joiner, space, BOM
    "👩\u200d👩\u200d👧",  # one glyph, five code points
    "e\u0301\u0301\u0301",  # stacked combining accents
    "\U0001d518\U0001d52b\U0001d526",  # outside the BMP: surrogate pairs in JSON
    "\U0010fffd",  # the last private-use code point
    "\x7f\x1b[31m",  # DEL and an ANSI escape
]


# -- what a stored value must be ---------------------------------------------------------


def storable(value: object) -> bool:
    """Whether jsonb can hold ``value`` as it is: the oracle the client is tested against."""
    if value is None or isinstance(value, (bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return "\x00" not in value and not re.search("[\ud800-\udfff]", value)
    if isinstance(value, (list, tuple)):
        return all(storable(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and storable(k) and storable(v) for k, v in value.items())
    return False


def as_stored(value: object) -> object:
    """What jsonb gives back: tuples come back as lists."""
    if isinstance(value, (list, tuple)):
        return [as_stored(item) for item in value]
    if isinstance(value, dict):
        return {k: as_stored(v) for k, v in value.items()}
    return value


storable_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30)
text_values = storable_text | st.sampled_from(SQL_LOOKING + ODD_UNICODE)
# Small enough that their JSON has no exponent: large floats are tests/test_enqueue.py's.
storable_floats = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e15, max_value=1e15)
good_leaves = (
    st.none() | st.booleans() | st.integers(-(10**40), 10**40) | storable_floats | text_values
)
bad_leaves = (
    st.sampled_from([math.nan, math.inf, -math.inf])
    | st.text(max_size=5).map(lambda s: s + "\x00")
    | st.characters(categories=["Cs"]).map(lambda c: "x" + c)
    | st.binary(max_size=5)
    | st.sets(st.integers(), max_size=2)
    | st.builds(object)
    | st.complex_numbers(max_magnitude=10)
    | st.decimals(allow_nan=False, places=2, max_value=100, min_value=-100)
    | st.datetimes()
)
values = st.recursive(
    good_leaves | bad_leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(text_values, children, max_size=3)
        | st.dictionaries(st.integers(), children, min_size=1, max_size=2)
    ),
    max_leaves=12,
)
# Argument names: anything Python accepts in **kwargs, names jsonb cannot hold included.
argument_names = (
    text_values
    | st.text(max_size=5).map(lambda s: s + "\x00")
    | st.characters(categories=["Cs"]).map(lambda c: "name" + c)
)


def count_jobs(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(f"SELECT count(*) FROM {SCHEMA}.jobs").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def tx(chaos_db: ChaosDatabase) -> Iterator[psycopg.Connection[Any]]:
    """The test's connection inside a transaction that is rolled back at the end."""
    with chaos_db.conn.transaction(force_rollback=True):
        yield chaos_db.conn


def enqueue_by(path: str, conn: psycopg.Connection[Any], call: Any, args: dict[str, Any]) -> int:
    """Enqueue one job the way ``path`` says: one INSERT, or the bulk COPY."""
    if path == "insert":
        return int(call.enqueue(conn, **args))
    (job_id,) = app.enqueue_many(conn, [call.job(**args)])
    return int(job_id)


@SETTINGS
@given(
    args=st.dictionaries(argument_names, values, max_size=4),
    path=st.sampled_from(["insert", "copy"]),
)
def test_any_arguments_come_back_equal_or_are_refused_naming_the_argument(
    tx: psycopg.Connection[Any], args: dict[str, Any], path: str
) -> None:
    before = count_jobs(tx)
    with tx.transaction(force_rollback=True):
        if all(storable(k) and storable(v) for k, v in args.items()):
            job_id = enqueue_by(path, tx, echo, args)
            row = tx.execute(
                f"SELECT args, task, queue FROM {SCHEMA}.jobs WHERE id = %s", (job_id,)
            ).fetchone()
            assert row == (as_stored(args), "hostile.echo", HOSTILE_QUEUE)
            return
        with pytest.raises(skiplock.EnqueueError) as caught:
            enqueue_by(path, tx, echo, args)
        bad = [k for k, v in args.items() if not (storable(k) and storable(v))]
        assert any(f"{k!r}" in str(caught.value) for k in bad), caught.value
        assert count_jobs(tx) == before, "a refused job was written"
        assert tx.info.transaction_status == TransactionStatus.INTRANS


# -- options --------------------------------------------------------------------------------

NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
INT4_MAX = 2**31 - 1


def known_newline_bug(value: object) -> bool:
    """Names with one trailing newline pass the check (test_a_name_ending_in_a_newline...)."""
    return isinstance(value, str) and value.endswith("\n") and bool(NAME.fullmatch(value[:-1]))


queues = (
    st.from_regex(NAME, fullmatch=True)
    | st.text(max_size=140)
    | st.sampled_from([*SQL_LOOKING, *ODD_UNICODE, "", " ", "q" * 129, "chaos\x00"])
    | st.integers()
    | st.none()
).filter(lambda q: not known_newline_bug(q))
priorities = st.integers(-40000, 40000) | st.booleans() | st.floats() | st.sampled_from(["1", None])
# Past the int4 range is a known bug (test_max_attempts_past_the_column_type_is_refused).
max_attempts = st.integers(-3, INT4_MAX) | st.booleans() | st.floats() | st.just("3")
# Delays long enough to overflow a timestamp are a known bug (test_a_delay_past_...).
delays = (
    st.floats(min_value=-10, max_value=1e9)
    | st.sampled_from([math.nan, math.inf, -math.inf])
    | st.integers(-10, 10**9)
    | st.booleans()
    | st.just("5")
)
# Whole minutes (any offset, now that bulk enqueue converts run_at to UTC).
offsets = st.integers(-959, 959).map(lambda minutes: timedelta(minutes=minutes))
run_ats = (
    st.datetimes(
        min_value=datetime(2000, 1, 1),
        max_value=datetime(2100, 1, 1),
        timezones=st.builds(timezone, offsets),
    )
    | st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1))  # naive
    | st.just("2030-01-01T00:00:00+00:00")
)


def option_problems(options: dict[str, Any]) -> list[str]:
    """The options that are wrong, by name: the oracle for with_options."""
    wrong = []
    if "queue" in options and not (
        isinstance(options["queue"], str) and NAME.fullmatch(options["queue"])
    ):
        wrong.append("queue")
    if "priority" in options:
        p = options["priority"]
        if not (isinstance(p, int) and not isinstance(p, bool) and -32768 <= p <= 32767):
            wrong.append("priority")
    if "max_attempts" in options:
        m = options["max_attempts"]
        if not (isinstance(m, int) and not isinstance(m, bool) and 1 <= m <= INT4_MAX):
            wrong.append("max_attempts")
    if "run_at" in options:
        r = options["run_at"]
        if not (isinstance(r, datetime) and r.tzinfo is not None):
            wrong.append("run_at")
    if "delay" in options:
        d = options["delay"]
        if not (
            isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d) and d >= 0
        ):
            wrong.append("delay")
    if "run_at" in options and "delay" in options:
        wrong.append("run_at or delay")
    return wrong


@SETTINGS
@given(
    options=st.fixed_dictionaries(
        {},
        optional={
            "queue": queues,
            "priority": priorities,
            "max_attempts": max_attempts,
            "run_at": run_ats,
            "delay": delays,
        },
    ),
    path=st.sampled_from(["insert", "copy"]),
)
def test_any_options_are_stored_as_given_or_refused_naming_the_option(
    tx: psycopg.Connection[Any], options: dict[str, Any], path: str
) -> None:
    before = count_jobs(tx)
    wrong = option_problems(options)
    with tx.transaction(force_rollback=True):
        if wrong:
            with pytest.raises(skiplock.ConfigurationError) as caught:
                enqueue_by(path, tx, echo.with_options(**options), {})
            assert any(name in str(caught.value) for name in wrong), caught.value
            assert count_jobs(tx) == before, "a refused job was written"
            assert tx.info.transaction_status == TransactionStatus.INTRANS
            return
        job_id = enqueue_by(path, tx, echo.with_options(**options), {})
        row = tx.execute(
            f"SELECT queue, priority, max_attempts, run_at, state, run_at > now(), now()"
            f" FROM {SCHEMA}.jobs WHERE id = %s",
            (job_id,),
        ).fetchone()
    assert row is not None
    queue, priority, attempts, run_at, state, future, now = row
    assert (queue, priority, attempts) == (
        options.get("queue", HOSTILE_QUEUE),
        options.get("priority", 0),
        options.get("max_attempts", 1),
    )
    assert state == ("scheduled" if future else "available")
    if "run_at" in options:
        assert run_at == options["run_at"]
    if options.get("delay"):
        assert abs((run_at - now).total_seconds() - options["delay"]) < 0.001


task_names = (
    st.from_regex(re.compile(r"[A-Za-z0-9_.:\-]{1,255}"), fullmatch=True)
    | st.text(max_size=260)
    | st.sampled_from([*SQL_LOOKING, *ODD_UNICODE, "", "t" * 256])
).filter(lambda n: not known_newline_bug(n))


@SETTINGS
@given(name=task_names)
def test_a_task_name_is_registered_as_given_or_refused_at_definition(name: str) -> None:
    offline = skiplock.App("postgresql://unused.invalid/none", schema=SCHEMA)
    if re.fullmatch(r"[A-Za-z0-9_.:\-]{1,255}", name):
        task = offline.task(name=name)(lambda: None)
        assert task.name == name and offline.tasks == {name: task}
        return
    with pytest.raises(skiplock.ConfigurationError, match="task name"):
        offline.task(name=name)(lambda: None)
    assert offline.tasks == {}


def test_arguments_past_the_size_limit_are_refused_naming_the_limit(
    tx: psycopg.Connection[Any],
) -> None:
    before = count_jobs(tx)
    for path in ("insert", "copy"):
        with pytest.raises(skiplock.EnqueueError, match=f"the limit is {MAX_ARGS_BYTES}"):
            enqueue_by(path, tx, echo, {"blob": "x" * MAX_ARGS_BYTES})
    assert count_jobs(tx) == before
    assert tx.info.transaction_status == TransactionStatus.INTRANS


# -- the plain SQL path ---------------------------------------------------------------------


@pytest.mark.parametrize("args", ["[]", "[{}]", "1", '"text"', "true", "null"])
def test_plain_sql_refuses_arguments_that_are_not_an_object(
    tx: psycopg.Connection[Any], args: str
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as caught, tx.transaction():
        tx.execute(
            f"INSERT INTO {SCHEMA}.jobs (task, args) VALUES ('hostile.echo', %s::jsonb)", (args,)
        )
    assert caught.value.diag.constraint_name == "jobs_args_object"


# -- broken rows under a real worker --------------------------------------------------------

# (task, args as written by hand, error type stored, words of its message)
BROKEN_ROWS: list[tuple[str, dict[str, Any], str, str]] = [
    ("hostile.strict", {}, "TypeError", "missing 1 required"),
    ("hostile.strict", {"order_id": 1, "surprise": True}, "TypeError", "'surprise'"),
    ("hostile.strict", {"order_id": 1, "conn": 2}, "TypeError", "'conn'"),
    ("hostile.strict", {"order_id": "1"}, "TypeError", "str"),
    ("hostile.strict", {"order_id": [1]}, "TypeError", "list"),
    ("hostile.strict", {"order_id": 1, "note": None}, "AttributeError", "upper"),
    ("no.such.task", {}, "UnknownTaskError", "'no.such.task'"),
    (SQL_LOOKING[0], {"x": 1}, "UnknownTaskError", "DROP TABLE"),
    ("hostile.echo\n", {}, "UnknownTaskError", "no task named"),
    ("\u202ehostile.echo", {}, "UnknownTaskError", "no task named"),
]


def insert_row(conn: psycopg.Connection[Any], task: str, args: dict[str, Any]) -> int:
    row = conn.execute(
        f"INSERT INTO {SCHEMA}.jobs (queue, task, args, max_attempts)"
        " VALUES (%s, %s, %s, 1) RETURNING id",
        (HOSTILE_QUEUE, task, Jsonb(args)),
    ).fetchone()
    assert row is not None
    return int(row[0])


def finished(conn: psycopg.Connection[Any], ids: list[int]) -> dict[int, tuple[str, Any, Any]]:
    """id -> (state, result, errors) of the jobs that are completed or dead."""
    rows = conn.execute(
        f"SELECT id, 'completed', result, errors FROM {SCHEMA}.job_history WHERE id = ANY(%s)"
        f" UNION ALL SELECT id, state, NULL, errors FROM {SCHEMA}.jobs"
        "  WHERE id = ANY(%s) AND state = 'dead'",
        (ids, ids),
    ).fetchall()
    return {int(r[0]): (str(r[1]), r[2], r[3]) for r in rows}


def hostile_args() -> list[dict[str, Any]]:
    """Arguments a worker must hand over intact: odd names, odd text, a large payload."""
    every = {f"k{i}": s for i, s in enumerate(SQL_LOOKING + ODD_UNICODE)}
    odd_names = {s: i for i, s in enumerate(SQL_LOOKING + ODD_UNICODE + ["", "a b", "ünï"])}
    return [every, odd_names, {"blob": "é" * (1024 * 1024)}, {"nested": [[[{"": None}]]]}]


def test_broken_rows_fail_with_their_error_while_the_worker_goes_on(
    chaos_db: ChaosDatabase, fleet: Fleet
) -> None:
    fleet.start_many(1, chaos_db.conn, queues=HOSTILE_QUEUE, concurrency=4)
    conn = chaos_db.conn
    broken = {
        insert_row(conn, task, args): (etype, words) for task, args, etype, words in BROKEN_ROWS
    }
    expected: dict[int, Any] = {int(echo.enqueue(conn, **args)): args for args in hostile_args()}
    expected[int(strict.enqueue(conn, order_id=41, note=SQL_LOOKING[0]))] = {
        "order_id": 42,
        "note": SQL_LOOKING[0].upper(),
    }
    ids = [*broken, *expected]

    wait_until(
        lambda: len(finished(conn, ids)) == len(ids),
        STEP_TIMEOUT,
        interval=POLL,
        what="every hostile job to finish",
        check=fleet.check,
    )
    outcomes = finished(conn, ids)
    for job_id, (etype, words) in broken.items():
        state, _, errors = outcomes[job_id]
        assert state == "dead", (job_id, outcomes[job_id])
        assert [e["type"] for e in errors] == [etype], errors
        assert words in errors[0]["message"], errors[0]
        assert errors[0]["traceback"], errors[0]
    for job_id, result in expected.items():
        state, stored, _ = outcomes[job_id]
        assert (state, stored) == ("completed", result), job_id

    # Still claiming after all that.
    later = [int(echo.enqueue(conn, n=i)) for i in range(5)]
    wait_until(
        lambda: len(finished(conn, later)) == 5,
        STEP_TIMEOUT,
        interval=POLL,
        what="later jobs",
        check=fleet.check,
    )


def test_rows_the_worker_cannot_decode_fail_alone_and_the_worker_goes_on(
    chaos_db: ChaosDatabase, fleet: Fleet
) -> None:
    """Valid jsonb that Python cannot decode (nesting past its recursion limit, an int past
    its digit limit) and a run_at before year 1, claimed in one batch with good jobs: each
    bad row fails alone, and the worker goes on claiming. (Until b04f623 such a row ended
    the producer, and the whole batch waited out its lease.)"""
    conn = chaos_db.conn
    poison = [
        insert_row(conn, "hostile.echo", {}),
        insert_row(conn, "hostile.echo", {}),
        insert_row(conn, "hostile.echo", {}),
    ]
    conn.execute(
        f"UPDATE {SCHEMA}.jobs SET args = jsonb_build_object('deep', %s::jsonb) WHERE id = %s",
        ("[" * 3000 + "]" * 3000, poison[0]),
    )
    conn.execute(
        f"UPDATE {SCHEMA}.jobs SET args = jsonb_build_object('big', %s::jsonb) WHERE id = %s",
        ("9" * 5000, poison[1]),
    )
    conn.execute(
        f"UPDATE {SCHEMA}.jobs SET run_at = '0044-03-15 00:00:00+00 BC' WHERE id = %s",
        (poison[2],),
    )
    good = [int(echo.enqueue(conn, n=i)) for i in range(8)]
    fleet.start_many(1, chaos_db.conn, queues=HOSTILE_QUEUE, concurrency=4)

    ids = poison + good
    wait_until(
        lambda: len(finished(conn, ids)) == len(ids),
        STEP_TIMEOUT,
        interval=POLL,
        what="the good jobs to complete and the undecodable ones to fail",
        check=fleet.check,
    )
    outcomes = finished(conn, ids)
    for job_id in poison[:2]:  # arguments Python cannot decode: failed, with the reason
        state, _, errors = outcomes[job_id]
        assert state == "dead", outcomes[job_id]
        assert "decode" in errors[-1]["message"], errors
    # A run_at before year 1 is only odd: the job runs.
    assert outcomes[poison[2]][:2] == ("completed", {})
    assert all(outcomes[i][:2] == ("completed", {"n": n}) for n, i in enumerate(good))


@pytest.mark.parametrize("name", ["a\x00b", "a\ud800"])
def test_an_argument_name_jsonb_cannot_hold_is_refused_at_enqueue(
    tx: psycopg.Connection[Any], name: str
) -> None:
    for path in ("insert", "copy"):
        with tx.transaction(force_rollback=True):
            with pytest.raises(skiplock.EnqueueError, match="argument name"):
                enqueue_by(path, tx, echo, {name: 1})
            assert tx.info.transaction_status == TransactionStatus.INTRANS


def test_arguments_nested_too_deep_are_refused_with_an_enqueue_error(
    tx: psycopg.Connection[Any],
) -> None:
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(skiplock.EnqueueError, match="argument 'deep' is nested too deeply"):
        echo.enqueue(tx, deep=deep)
    assert tx.info.transaction_status == TransactionStatus.INTRANS


# -- known bugs ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["insert", "copy"])
def test_max_attempts_past_the_column_type_is_refused(
    tx: psycopg.Connection[Any], path: str
) -> None:
    with tx.transaction(force_rollback=True), pytest.raises(skiplock.ConfigurationError):
        enqueue_by(path, tx, echo.with_options(max_attempts=2**31), {})


@pytest.mark.parametrize("path", ["insert", "copy"])
def test_a_delay_past_any_timestamp_is_refused(tx: psycopg.Connection[Any], path: str) -> None:
    with tx.transaction(force_rollback=True), pytest.raises(skiplock.ConfigurationError):
        enqueue_by(path, tx, echo.with_options(delay=1e300), {})


@pytest.mark.parametrize(
    "offset", [timedelta(hours=23, minutes=30), timedelta(seconds=1, microseconds=1)]
)
def test_bulk_enqueue_takes_any_aware_run_at_that_single_enqueue_takes(
    tx: psycopg.Connection[Any], offset: timedelta
) -> None:
    call = echo.with_options(run_at=datetime(2030, 1, 1, tzinfo=timezone(offset)))
    with tx.transaction(force_rollback=True):
        assert enqueue_by("insert", tx, call, {})
    with tx.transaction(force_rollback=True):
        assert enqueue_by("copy", tx, call, {})


@pytest.mark.parametrize("kind", ["queue", "task", "schema"])
def test_a_name_ending_in_a_newline_is_refused(kind: str) -> None:
    offline = skiplock.App("postgresql://unused.invalid/none", schema=SCHEMA)
    with pytest.raises(skiplock.ConfigurationError):
        if kind == "queue":
            echo.with_options(queue="chaos\n")
        elif kind == "task":
            offline.task(name="chaos.task\n")(lambda: None)
        else:
            skiplock.App("postgresql://unused.invalid/none", schema="skiplock\n")


@pytest.mark.parametrize("key", ["a\x00b", "a\ud800"])
def test_a_unique_key_text_cannot_hold_is_refused(tx: psycopg.Connection[Any], key: str) -> None:
    with tx.transaction(force_rollback=True), pytest.raises(skiplock.ConfigurationError):
        echo.with_options(unique_key=key).enqueue(tx)
