"""One bad outcome stays one bad outcome (issue 10, items 1, 2, 4 and the completer's part
of 13), with real workers.

A handler that returns what PostgreSQL cannot store, raises with a message it cannot
store, or asks for a retry at a time that cannot be, fails *its* job with the reason
recorded, while a good job finishing in the same flush completes exactly once. The
completer itself splits a batch PostgreSQL refuses until the refused outcome is alone,
and is flushed by one task at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

import skiplock
from semantics.conftest import Calls, Sem, StartWorkers
from skiplock.completer import Completer
from skiplock.outcomes import Cancelled, Completed, Retried, Snoozed
from skiplock.retry import RetryPolicy

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

# Both handlers of a pair finish together and the completer waits long enough to gather
# both outcomes into one flush: the good one shares the bad one's batch.
TOGETHER: dict[str, Any] = {"completer_interval": 0.2, "concurrency": 4}
NO_RETRY_DELAY = RetryPolicy(base=0.0, cap=0.0, jitter=0.0)


class _Pair:
    """A good and a bad handler that wait for each other before they return."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=20)
        self.calls = Calls()

    def meet(self, key: str) -> None:
        self.calls.record(key)
        # A re-run (old code) finds no partner: it still has to finish.
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait()


def _enqueue_pair(sem: Sem, pair: _Pair, bad: Any) -> tuple[int, int]:
    @sem.app.task(name="good", max_attempts=1)
    def good() -> dict[str, str]:
        pair.meet("good")
        return {"fine": "yes"}

    @sem.app.task(name="bad", max_attempts=1)
    def bad_handler() -> Any:
        pair.meet("bad")
        return bad()

    return sem.enqueue(good), sem.enqueue(bad_handler)


def _assert_good_ran_once(sem: Sem, pair: _Pair, good_id: int) -> None:
    done = sem.wait_for_state(good_id, "completed")
    assert done.result == {"fine": "yes"}
    assert pair.calls.counts["good"] == 1


UNSTORABLE_RESULTS = {
    "nul": lambda: "a\x00b",
    "lone surrogate": lambda: "\ud800",
    "inf": lambda: math.inf,
    "nan": lambda: math.nan,
    "-inf nested": lambda: {"rows": [1, {"x": -math.inf}]},
    "nul nested": lambda: {"rows": [1, {"note": "x\x00"}]},
    "nul in a key": lambda: {"k\x00": 1},
    "int too long": lambda: 10**5000,
}


@pytest.mark.parametrize("make", UNSTORABLE_RESULTS.values(), ids=UNSTORABLE_RESULTS.keys())
def test_an_unstorable_result_fails_its_job_and_the_batch_is_written(
    sem: Sem, workers: StartWorkers, make: Any
) -> None:
    pair = _Pair()
    good_id, bad_id = _enqueue_pair(sem, pair, make)
    (worker,) = workers(1, **TOGETHER)

    failed = sem.wait_for_state(bad_id, "dead")
    error = failed.errors[-1]
    assert error["message"].startswith("result not storable: "), error
    assert failed.result is None
    _assert_good_ran_once(sem, pair, good_id)
    assert pair.calls.counts["bad"] == 1
    stats = worker.worker.completer.stats  # type: ignore[union-attr]
    assert (stats.dropped, stats.refused) == (0, 0)


def test_a_result_json_cannot_hold_by_type_is_still_stored_as_its_repr(
    sem: Sem, workers: StartWorkers
) -> None:
    pair = _Pair()
    good_id, bad_id = _enqueue_pair(sem, pair, lambda: {frozenset({"a\x00"})})
    workers(1, **TOGETHER)

    done = sem.wait_for_state(bad_id, "completed")
    assert done.result == {"repr": "{frozenset({'a\\x00'})}"}
    _assert_good_ran_once(sem, pair, good_id)


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


UNSTORABLE_ERRORS = {
    "nul": (lambda: ValueError("bad \x00 byte"), "bad \\x00 byte"),
    "lone surrogate": (lambda: ValueError("half \ud800 char"), "half \\ud800 char"),
    "str raises": (_UnprintableError, "<_UnprintableError: str() raised RuntimeError>"),
}


@pytest.mark.parametrize(
    ("make", "message"), UNSTORABLE_ERRORS.values(), ids=UNSTORABLE_ERRORS.keys()
)
def test_an_unstorable_error_message_is_recorded_sanitised(
    sem: Sem, workers: StartWorkers, make: Any, message: str
) -> None:
    pair = _Pair()

    def fail() -> None:
        raise make()

    good_id, bad_id = _enqueue_pair(sem, pair, fail)
    workers(1, **TOGETHER)

    failed = sem.wait_for_state(bad_id, "dead")
    assert failed.errors[-1]["message"] == message
    assert "\x00" not in failed.errors[-1]["traceback"]
    _assert_good_ran_once(sem, pair, good_id)


FAR = datetime(9999, 12, 31, tzinfo=UTC)
IMPOSSIBLE_TIMES = {
    "inf": math.inf,
    "nan": math.nan,
    "1e300 seconds": 1e300,
    "timedelta.max": timedelta.max,
    "year 9999": FAR,
    "not a time": "soon",
}


@pytest.mark.parametrize("after", IMPOSSIBLE_TIMES.values(), ids=IMPOSSIBLE_TIMES.keys())
@pytest.mark.parametrize("steer", ["Retry", "Snooze"])
def test_a_retry_or_snooze_at_an_impossible_time_is_a_recorded_failure(
    sem: Sem, workers: StartWorkers, after: Any, steer: str
) -> None:
    pair = _Pair()

    def ask() -> None:
        raise skiplock.Retry(after=after) if steer == "Retry" else skiplock.Snooze(after)

    good_id, bad_id = _enqueue_pair(sem, pair, ask)
    workers(1, **TOGETHER)

    failed = sem.wait_for_state(bad_id, "dead")
    error = failed.errors[-1]
    assert error["type"] == "OutcomeNotStorableError"
    assert error["message"].startswith(f"{steer}(after="), error
    _assert_good_ran_once(sem, pair, good_id)


def test_a_retry_in_the_past_runs_again_at_once(sem: Sem, workers: StartWorkers) -> None:
    calls = Calls()

    @sem.app.task(name="again", max_attempts=2, retry=NO_RETRY_DELAY)
    def again() -> str:
        if calls.record("again") == 1:
            raise skiplock.Retry(after=-5, reason="past")
        return "second"

    job_id = sem.enqueue(again)
    workers(1)
    done = sem.wait_for_state(job_id, "completed")
    assert (done.result, done.attempts, [e["message"] for e in done.errors]) == (
        "second",
        2,
        ["past"],
    )


# -- the completer on its own -----------------------------------------------------------


def _leased_jobs(sem: Sem, worker_id: uuid.UUID, count: int) -> list[int]:
    """Jobs running under ``worker_id``, attempt 1, as a claim would leave them."""
    rows = sem.execute(
        "INSERT INTO {jobs} (task, args, queue, state, attempts, max_attempts, worker_id, "
        "lease_expires_at, attempted_at) "
        "SELECT 'noop', jsonb_build_object(), 'default', 'running', 1, 3, %(worker)s, "
        "now() + interval '1 hour', now() FROM generate_series(1, %(count)s) RETURNING id",
        {"worker": worker_id, "count": count},
    )
    return sorted(int(r[0]) for r in rows)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_completer(
    sem: Sem, worker_id: uuid.UUID, body: Any, max_batch: int = 1000
) -> Completer:
    async with AsyncConnectionPool(
        sem.url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
    ) as pool:
        completer = Completer(pool, sem.schema, worker_id, interval=0.0, max_batch=max_batch)
        await body(completer)
        return completer


def test_a_refused_outcome_is_isolated_and_the_rest_of_the_batch_is_written(sem: Sem) -> None:
    """Values the executor would never produce (JSON text jsonb refuses, written by
    hand): the completer splits the batch and records the refused ones as failures."""
    worker_id = uuid.uuid4()
    ids = _leased_jobs(sem, worker_id, 40)
    bad = {ids[3], ids[17], ids[18], ids[39]}

    async def body(completer: Completer) -> None:
        for job_id in ids:
            result = '"\\u0000"' if job_id in bad else '{"n": 1}'
            completer.add(Completed(job_id, 1, result_json=result))
        await completer.flush()
        assert completer.backlog == 0

    completer = _run(_with_completer(sem, worker_id, body))
    history = dict(sem.execute("SELECT id, result FROM {history} WHERE state = 'completed'"))
    assert set(history) == set(ids) - bad
    assert all(result == {"n": 1} for result in history.values())
    failed = sem.execute("SELECT id, state, attempts, errors FROM {jobs} ORDER BY id")
    assert [row[0] for row in failed] == sorted(bad)
    for _, state, attempts, errors in failed:
        assert (state, attempts) == ("retryable", 1)
        assert errors[-1]["message"].startswith("result not storable: "), errors
    stats = completer.stats
    assert (stats.completed, stats.unstorable, stats.refused, stats.dropped) == (36, 4, 0, 0)


def test_refused_outcomes_of_every_kind_fail_alone(sem: Sem) -> None:
    worker_id = uuid.uuid4()
    ids = _leased_jobs(sem, worker_id, 4)
    bad_error = {"attempt": 1, "type": "E\x00", "message": "bad \x00 \ud800"}

    async def body(completer: Completer) -> None:
        # A failure whose error holds a NUL and a lone surrogate (made storable before the
        # write), and a cancel and a snooze whose progress jsonb refuses (left out: it is
        # a side note).
        completer.add(Retried(ids[0], 1, error=bad_error, delay=0.0))
        completer.add(Cancelled(ids[1], 1, progress_json='"\\u0000"'))
        completer.add(Snoozed(ids[2], 1, delay=0.0, progress_json='"\\ud800"'))
        completer.add(Completed(ids[3], 1, result_json="1"))
        await completer.flush()

    completer = _run(_with_completer(sem, worker_id, body))
    stats = completer.stats
    assert (stats.retried, stats.cancelled, stats.snoozed, stats.completed) == (1, 1, 1, 1)
    assert (stats.unstorable, stats.dropped) == (0, 0)


def test_concurrent_flushes_write_each_outcome_once(sem: Sem) -> None:
    """The shutdown drain flushes while run() may be flushing too: they take turns."""
    worker_id = uuid.uuid4()
    ids = _leased_jobs(sem, worker_id, 300)

    async def body(completer: Completer) -> None:
        for job_id in ids:
            completer.add(Completed(job_id, 1, result_json="1"))
        await asyncio.gather(*(completer.flush() for _ in range(3)))
        assert completer.backlog == 0

    completer = _run(_with_completer(sem, worker_id, body, max_batch=100))
    assert (completer.stats.completed, completer.stats.refused) == (300, 0)
    assert sem.execute("SELECT count(*) FROM {history}")[0][0] == 300


def test_an_error_no_row_caused_keeps_the_batch_for_the_next_try(
    sem: Sem, caplog: pytest.LogCaptureFixture
) -> None:
    """A missing table (or privilege) fails every row alike: the batch is neither split
    nor dropped, and is written once the database takes it."""
    worker_id = uuid.uuid4()
    ids = _leased_jobs(sem, worker_id, 3)

    async def body(completer: Completer) -> None:
        for job_id in ids:
            completer.add(Completed(job_id, 1, result_json="1"))
        runner = asyncio.create_task(completer.run())
        try:

            async def failed_twice() -> None:
                # Tried twice, or (as before) given up on: "could not write ...".
                while not any("could not write" in r.message for r in caplog.records) and (
                    sum("writing outcomes failed" in r.message for r in caplog.records) < 2
                ):
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(failed_twice(), 20)
        finally:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        assert (completer.backlog, completer.stats.dropped) == (3, 0)

    async def run() -> None:
        async with AsyncConnectionPool(
            sem.url, min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
        ) as pool:
            # The schema's tables are not there: every statement fails the same way.
            await body(Completer(pool, f"{sem.schema}_missing", worker_id, interval=0.0))

    _run(run())
    assert sem.execute("SELECT count(*) FROM {jobs} WHERE state = 'running'")[0][0] == 3


def test_progress_postgresql_cannot_store_is_refused_in_the_handler(
    sem: Sem, workers: StartWorkers
) -> None:
    said: list[str] = []

    @sem.app.task(name="reporting")
    def reporting() -> str:
        skiplock.set_progress({"done": 1})
        try:
            skiplock.set_progress({"note": "x\x00"})
        except ValueError as refused:
            said.append(str(refused))
        return "done"

    job_id = sem.enqueue(reporting)
    workers(1)
    done = sem.wait_for_state(job_id, "completed")
    assert (done.result, done.progress) == ("done", {"done": 1})
    assert said == ["progress not storable: the string at $.note contains a NUL character"]


def test_a_row_postgresql_refuses_whatever_is_written_is_left_alone(sem: Sem) -> None:
    """A trigger (say) refuses every write of one row: the others are written, that one
    is left to its lease (counted as dropped) after a plain failure was refused too."""
    worker_id = uuid.uuid4()
    ids = _leased_jobs(sem, worker_id, 10)
    victim = ids[6]
    with sem.connect() as conn:
        conn.execute(
            f'CREATE FUNCTION "{sem.schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS $$ '
            f"BEGIN IF OLD.id = {victim} THEN "
            "RAISE EXCEPTION 'refused row' USING ERRCODE = '22000'; END IF; "
            "IF TG_OP = 'DELETE' THEN RETURN OLD; END IF; RETURN NEW; END $$"
        )
        conn.execute(
            f'CREATE TRIGGER refuse BEFORE UPDATE OR DELETE ON "{sem.schema}".jobs '
            f'FOR EACH ROW EXECUTE FUNCTION "{sem.schema}".refuse()'
        )

    async def body(completer: Completer) -> None:
        for job_id in ids:
            completer.add(Completed(job_id, 1, result_json="1"))
        await completer.flush()
        assert completer.backlog == 0

    completer = _run(_with_completer(sem, worker_id, body))
    stats = completer.stats
    assert (stats.completed, stats.dropped, stats.refused, stats.unstorable) == (9, 1, 0, 0)
    left = sem.execute("SELECT id, state FROM {jobs}")
    assert left == [(victim, "running")]
