"""Replace and debounce (decision 028): a unique enqueue whose key is held by a job that
waits to start gives that job its own values instead of being refused; a debounce pushes
the holder's run time back on every enqueue. A holder that started is never changed."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import skiplock
from skiplock import client

from .conftest import Sem, StartWorkers

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(60)]


def row(sem: Sem, job_id: int) -> dict[str, Any]:
    found = sem.execute(
        "SELECT args, state, priority, max_attempts, extract(epoch FROM run_at - now())::float8 "
        "FROM {jobs} WHERE id = %s",
        (job_id,),
    )
    assert found, f"job {job_id} is not live"
    args, state, priority, attempts, due_in = found[0]
    return {
        "args": args,
        "state": state,
        "priority": priority,
        "max_attempts": attempts,
        "due_in": due_in,
    }


def test_replace_gives_the_waiting_holder_the_new_arguments_and_only_those(sem: Sem) -> None:
    @sem.app.task(name="report", unique="report:daily", replace=("args",))
    def report(day: str) -> None: ...

    first = sem.enqueue(report.with_options(delay=600, priority=5), day="mon")
    again = sem.enqueue(report.with_options(priority=-3), day="tue")

    assert again == first and again.duplicate
    replaced = row(sem, first)
    assert replaced["args"] == {"day": "tue"}
    # Not asked for: the run time and the priority stay the holder's.
    assert replaced["state"] == "scheduled" and replaced["due_in"] > 500
    assert replaced["priority"] == 5
    assert sem.live_count() == 1


def test_replace_true_takes_every_field_and_a_run_time_of_now_makes_it_available(
    sem: Sem,
) -> None:
    @sem.app.task(name="sync", unique=True)
    def sync(account: int, full: bool = False) -> None: ...

    first = sem.enqueue(sync.with_options(unique_key="acct:1", delay=3600), account=1)
    assert row(sem, first)["state"] == "scheduled"
    again = sem.enqueue(
        sync.with_options(unique_key="acct:1", replace=True, priority=-1, max_attempts=9),
        account=1,
        full=True,
    )

    assert again == first
    replaced = row(sem, first)
    assert replaced["args"] == {"account": 1, "full": True}
    assert replaced["priority"] == -1 and replaced["max_attempts"] == 9
    assert replaced["state"] == "available" and replaced["due_in"] <= 0


def test_debounce_runs_the_job_once_after_the_last_enqueue(sem: Sem, workers: StartWorkers) -> None:
    runs: list[int] = []

    @sem.app.task(name="digest", unique=True, debounce=timedelta(seconds=30))
    def digest(user: int) -> None:
        runs.append(user)

    first = sem.enqueue(digest, user=7)
    assert 29 < row(sem, first)["due_in"] <= 30
    # Ten seconds later (the run time moved back by hand, as the clock would have).
    sem.execute("UPDATE {jobs} SET run_at = run_at - interval '10 seconds' WHERE id = %s", (first,))
    assert row(sem, first)["due_in"] <= 20
    again = sem.enqueue(digest, user=7)
    assert again == first and again.duplicate
    assert 29 < row(sem, first)["due_in"] <= 30  # pushed back to 30 s from this enqueue
    other = sem.enqueue(digest, user=8)
    assert other != first

    # Due now: it runs once, for both enqueues.
    sem.execute("UPDATE {jobs} SET run_at = now() WHERE id = %s", (first,))
    workers(1)
    sem.wait_for_state(first, "completed")
    assert runs == [7]
    assert sem.state_of(other) == "scheduled"


def test_a_debounced_job_that_started_is_not_changed_and_a_new_one_waits(
    sem: Sem, workers: StartWorkers
) -> None:
    """The key is held only while the job waits (unique_scope 'queued'): an enqueue while
    it runs makes the next one, so the change it announces is not missed."""
    running = threading.Event()
    release = threading.Event()

    @sem.app.task(name="digest", unique=True, debounce=60)
    def digest(user: int) -> None:
        running.set()
        release.wait(20)

    first = sem.enqueue(digest, user=1)
    sem.execute("UPDATE {jobs} SET run_at = now() WHERE id = %s", (first,))
    workers(1)
    assert running.wait(15)
    during = sem.enqueue(digest, user=1)
    assert during != first and not during.duplicate
    assert row(sem, during)["state"] == "scheduled"
    release.set()
    sem.wait_for_state(first, "completed")
    assert sem.enqueue(digest, user=1) == during


def test_a_running_holder_in_the_active_scope_is_returned_unchanged(
    sem: Sem, workers: StartWorkers
) -> None:
    running = threading.Event()
    release = threading.Event()
    seen: list[Any] = []

    @sem.app.task(name="rebuild", unique="rebuild", replace=True)
    def rebuild(version: int) -> None:
        seen.append(version)
        running.set()
        release.wait(20)

    first = sem.enqueue(rebuild, version=1)
    workers(1)
    assert running.wait(15)
    again = sem.enqueue(rebuild, version=2)
    assert again == first and again.duplicate
    release.set()
    sem.wait_for_state(first, "completed")
    assert seen == [1]
    assert sem.job(first).args == {"version": 1}


def test_a_holder_that_failed_once_is_not_replaced(sem: Sem) -> None:
    @sem.app.task(name="push", unique="push", replace=("args",))
    def push(n: int) -> None: ...

    first = sem.enqueue(push, n=1)
    # As a failed attempt leaves it (attempted, waiting for its retry).
    sem.execute(
        "UPDATE {jobs} SET state = 'retryable', attempts = 1, retry_at = now() + interval '1 h' "
        "WHERE id = %s",
        (first,),
    )
    assert sem.enqueue(push, n=2) == first
    assert row(sem, first)["args"] == {"n": 1}


def test_a_keyed_holder_waiting_for_its_key_is_replaced_and_stays_blocked(sem: Sem) -> None:
    @sem.app.task(name="charge", unique=True, replace=("args", "run_at"))
    def charge(order: int, cents: int) -> None: ...

    keyed = charge.with_options(ordering_key="customer:1")
    head = sem.enqueue(keyed.with_options(unique_key="head"), order=1, cents=100)
    waiting = sem.enqueue(keyed.with_options(unique_key="order:2"), order=2, cents=200)
    assert row(sem, waiting)["state"] == "blocked"
    again = sem.enqueue(keyed.with_options(unique_key="order:2"), order=2, cents=250)
    assert again == waiting
    assert row(sem, waiting) | {"due_in": None} == {
        "args": {"order": 2, "cents": 250},
        "state": "blocked",
        "priority": 0,
        "max_attempts": 3,
        "due_in": None,
    }
    assert head != waiting


def test_bulk_enqueue_replaces_key_by_key_and_returns_the_holders(sem: Sem) -> None:
    @sem.app.task(name="index", unique=True, replace=("args",))
    def index(page: int, text: str = "") -> None: ...

    first = sem.enqueue(index.with_options(unique_key="p1"), page=1, text="old")
    ids = sem.enqueue_many(
        [
            index.with_options(unique_key="p1").job(page=1, text="new"),
            index.with_options(unique_key="p2").job(page=2, text="two"),
            index.with_options(unique_key="p2").job(page=2, text="two, again"),
        ]
    )
    assert ids[0] == first
    assert ids[1] == ids[2] != first
    assert row(sem, first)["args"] == {"page": 1, "text": "new"}
    assert row(sem, ids[1])["args"] == {"page": 2, "text": "two, again"}


def test_two_sessions_racing_to_replace_leave_one_job_with_one_of_their_values(
    sem: Sem,
) -> None:
    @sem.app.task(name="flag", unique="flag", replace=("args",))
    def flag(n: int) -> None: ...

    first = sem.enqueue(flag.with_options(delay=600), n=0)
    holding = sem.connect(autocommit=False)
    try:
        assert flag.enqueue(holding, n=1) == first  # its UPDATE holds the row
        done: list[int] = []
        racer = threading.Thread(target=lambda: done.append(int(sem.enqueue(flag, n=2))))
        racer.start()
        racer.join(1.0)
        assert racer.is_alive()  # waits for the first replacement's transaction
        holding.commit()
        racer.join(10)
        assert done == [first]
    finally:
        holding.close()
    assert row(sem, first)["args"] == {"n": 2}
    assert sem.live_count() == 1


def test_the_async_path_replaces_too(sem: Sem) -> None:
    @sem.app.task(name="warm", unique="warm", debounce=120)
    def warm(n: int) -> None: ...

    async def main() -> tuple[int, int]:
        async with await psycopg.AsyncConnection.connect(sem.url) as conn:
            first = await warm.enqueue_async(conn, n=1)
            again = await warm.enqueue_async(conn, n=2)
            await conn.commit()
        return int(first), int(again)

    first, again = asyncio.run(main())
    assert first == again
    # debounce replaces the run time only; the arguments stay the first enqueue's.
    assert row(sem, first)["args"] == {"n": 1}
    assert row(sem, first)["state"] == "scheduled"


def test_plain_sql_can_replace_through_the_function(sem: Sem) -> None:
    @sem.app.task(name="note", unique="note", replace=("args",))
    def note(text: str) -> None: ...

    first = sem.enqueue(note, text="a")
    call = "SELECT {schema}.job_replace_waiting(%s, NULL, %s, %s, NULL, NULL, NULL)"
    # No key given: nothing to replace.
    assert sem.execute(call, (None, ["args"], '{"text": "b"}')) == [(None,)]
    assert sem.execute(call, ("note", ["args"], '{"text": "b"}')) == [(first,)]
    assert row(sem, first)["args"] == {"text": "b"}
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="fields must name"):
        sem.execute(call, ("note", ["state"], "{}"))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="has no new value"):
        sem.execute(call, ("note", ["args"], None))
    assert row(sem, first)["args"] == {"text": "b"}


# -- bad input: refused when the task or the call is defined, nothing written ---------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replace": True}, "replace needs unique=True or a unique key"),
        ({"debounce": 5}, "debounce needs unique=True or a unique key"),
        ({"unique": True, "replace": ("args", "state")}, "'state' cannot be replaced"),
        ({"unique": True, "replace": ("arg",)}, "did you mean 'args'"),
        ({"unique": True, "replace": 3}, "replace must be True or some of"),
        ({"unique": True, "debounce": -1}, "debounce must be a positive number"),
        (
            {"unique": True, "debounce": 5, "unique_scope": "active"},
            "debounce holds its key only while the job waits",
        ),
        (
            {"unique": True, "replace": True, "unique_window": 60},
            "replace cannot be combined with unique_window",
        ),
    ],
)
def test_bad_task_options_are_refused_with_a_clear_error(
    sem: Sem, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(skiplock.ConfigurationError, match=message):
        sem.app.task(name="bad", **options)(lambda: None)


def test_bad_call_options_are_refused_before_anything_is_written(sem: Sem) -> None:
    @sem.app.task(name="plain")
    def plain(n: int) -> None: ...

    @sem.app.task(name="debounced", unique=True, debounce=10)
    def debounced(n: int) -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="needs a unique_key"):
        sem.enqueue(plain.with_options(replace=True), n=1)
    with pytest.raises(skiplock.ConfigurationError, match="give it or run_at/delay"):
        plain.with_options(unique_key="k", debounce=5, delay=3)
    with pytest.raises(skiplock.ConfigurationError, match="give no run_at or delay"):
        sem.enqueue(debounced.with_options(delay=3), n=1)
    with pytest.raises(skiplock.ConfigurationError, match="only while the job waits"):
        sem.enqueue(debounced.with_options(unique_scope="active"), n=1)
    with sem.connect() as conn:
        assert client.list_jobs(conn, sem.schema) == []
