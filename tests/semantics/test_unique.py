"""Unique jobs: a live job holding a key turns every further enqueue of that key into a
reference to itself (``ref.duplicate``), by a partial unique index and ON CONFLICT.

Scope 'active' holds the key while the job is scheduled, available, running or
retryable; 'queued' only until the job starts. Dead and finished jobs hold nothing.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import WorkerThread, wait_until
from skiplock import client, history
from skiplock.retry import RetryPolicy
from skiplock.worker import producer

from .conftest import Calls, RunCli, Sem, StartWorkers

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(60)]

AN_HOUR = RetryPolicy(base=3600.0, cap=3600.0, jitter=0.0)


def keys_of(sem: Sem, job_id: int) -> tuple[str | None, str | None]:
    """(unique_key, unique_queued_key) of a live job."""
    rows = sem.execute("SELECT unique_key, unique_queued_key FROM {jobs} WHERE id = %s", (job_id,))
    assert rows, f"job {job_id} is not live"
    return rows[0][0], rows[0][1]


# -- keys ------------------------------------------------------------------------------


def test_a_task_unique_on_its_arguments_returns_the_holder_whatever_their_order(
    sem: Sem,
) -> None:
    @sem.app.task(name="transfer", unique=True)
    def transfer(source: int, target: int) -> None: ...

    first = sem.enqueue(transfer, source=1, target=2)
    again = sem.enqueue(transfer, target=2, source=1)
    other = sem.enqueue(transfer, source=2, target=1)

    assert first.duplicate is False
    assert again.duplicate is True
    assert int(again) == int(first)
    assert other.duplicate is False
    assert int(other) != int(first)
    assert sem.live_count() == 2


def test_the_async_enqueue_returns_the_holder_too(sem: Sem) -> None:
    @sem.app.task(name="notify", unique=True)
    def notify(user: int) -> None: ...

    async def enqueue_twice() -> tuple[skiplock.JobRef, skiplock.JobRef]:
        async with await psycopg.AsyncConnection.connect(sem.url) as conn:
            first = await notify.enqueue_async(conn, user=5)
            second = await notify.enqueue_async(conn, user=5)
            await conn.commit()
        return first, second

    first, second = asyncio.run(enqueue_twice())

    assert (first.duplicate, second.duplicate) == (False, True)
    assert int(second) == int(first)
    assert sem.live_count() == 1


def test_a_fixed_task_key_and_a_per_call_key_hold_whatever_the_arguments(sem: Sem) -> None:
    @sem.app.task(name="daily_report", unique="daily-report")
    def daily_report(day: str) -> None: ...

    @sem.app.task(name="send_invoice", unique=True)
    def send_invoice(number: int, copy: int = 0) -> None: ...

    report = sem.enqueue(daily_report, day="monday")
    report_again = sem.enqueue(daily_report, day="tuesday")
    # A per-call key replaces the key made of the arguments.
    invoice = sem.enqueue(send_invoice.with_options(unique_key="invoice:7"), number=7)
    invoice_copy = sem.enqueue(send_invoice.with_options(unique_key="invoice:7"), number=7, copy=1)
    by_arguments = sem.enqueue(send_invoice, number=7)

    assert report_again.duplicate and int(report_again) == int(report)
    assert invoice_copy.duplicate and int(invoice_copy) == int(invoice)
    assert not by_arguments.duplicate
    assert len({int(report), int(invoice), int(by_arguments)}) == 3
    assert keys_of(sem, invoice) == ("invoice:7", None)
    assert keys_of(sem, report) == ("daily-report", None)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique": True, "unique_scope": "x"}, "unique_scope='x'"),
        ({"unique": ""}, "non-empty"),
        ({"unique": 3}, "non-empty"),
    ],
)
def test_bad_task_unique_options_fail_at_definition(
    sem: Sem, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(skiplock.ConfigurationError, match=message):

        @sem.app.task(name="bad", **options)
        def bad() -> None: ...


def test_a_bad_per_call_unique_scope_fails_before_anything_is_written(sem: Sem) -> None:
    @sem.app.task(name="plain")
    def plain() -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="unique_scope='x'"):
        plain.with_options(unique_key="k", unique_scope="x")
    with pytest.raises(skiplock.ConfigurationError, match="non-empty"):
        plain.with_options(unique_key=7)
    assert sem.live_count() == 0


def test_an_empty_per_call_unique_key_fails(sem: Sem) -> None:
    @sem.app.task(name="plain")
    def plain() -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="non-empty"):
        plain.with_options(unique_key="")


# -- scopes ----------------------------------------------------------------------------


def test_the_active_scope_holds_the_key_until_the_job_finishes(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()
    running = threading.Event()
    release = threading.Event()

    @sem.app.task(name="sync_account", unique=True, max_attempts=2, retry=AN_HOUR)
    def sync_account(account: int) -> int:
        calls.record(account)
        if account == 2:
            raise ValueError("upstream is down")  # retryable for an hour
        running.set()
        release.wait(20)
        return account

    # Waiting: available, and scheduled.
    first = sem.enqueue(sync_account, account=1)
    assert sem.enqueue(sync_account, account=1) == first
    later = sem.enqueue(sync_account.with_options(delay=3600), account=3)
    assert sem.job(later).state is skiplock.JobState.SCHEDULED
    assert sem.enqueue(sync_account, account=3) == later
    failing = sem.enqueue(sync_account, account=2)

    workers(2)
    # Running.
    assert running.wait(15)
    assert sem.job(first).state is skiplock.JobState.RUNNING
    while_running = sem.enqueue(sync_account, account=1)
    assert while_running.duplicate and while_running == first
    # Retryable.
    sem.wait_for_state(failing, "retryable")
    while_retryable = sem.enqueue(sync_account, account=2)
    assert while_retryable.duplicate and while_retryable == failing

    # Completed: the key is free, and the new job runs.
    release.set()
    sem.wait_for_state(first, "completed")
    after = sem.enqueue(sync_account, account=1)
    assert not after.duplicate and after != first
    sem.wait_for_state(after, "completed")
    assert calls.counts == Counter({1: 2, 2: 1})


def test_a_dead_job_holds_no_key_and_retrying_it_runs_it_without_the_key(
    sem: Sem, workers: StartWorkers, run_cli: RunCli
) -> None:
    calls = Calls()
    hold = threading.Event()

    @sem.app.task(name="charge", unique=True, max_attempts=1)
    def charge(order: int) -> str:
        call = calls.record(order)
        if call == 1:
            raise ValueError("card declined")
        if call == 2:
            hold.wait(20)  # the newer job: keeps the key while the dead one is retried
        return f"charged on call {call}"

    workers(2)
    dead = sem.enqueue(charge, order=7)
    sem.wait_for_state(dead, "dead")

    newer = sem.enqueue(charge, order=7)
    assert not newer.duplicate and newer != dead
    sem.wait_for_state(newer, "running")

    retried = run_cli("jobs", "retry", str(dead))
    assert (retried.code, retried.err) == (0, "")

    # The retried job runs while the newer one still holds the key: without the key.
    done = sem.wait_for_state(dead, "completed")
    assert done.result == "charged on call 3"
    assert sem.execute("SELECT unique_key FROM {history} WHERE id = %s", (dead,)) == [(None,)]
    assert sem.job(newer).state is skiplock.JobState.RUNNING
    assert sem.enqueue(charge, order=7) == newer
    hold.set()
    assert sem.wait_for_state(newer, "completed").result == "charged on call 2"


def test_retrying_two_dead_jobs_that_share_a_key_retries_both(sem: Sem) -> None:
    @sem.app.task(name="charge", unique=True)
    def charge(order: int) -> None: ...

    older = sem.enqueue(charge, order=7)
    sem.execute("UPDATE {jobs} SET state = 'dead' WHERE id = %s", (older,))
    newer = sem.enqueue(charge, order=7)
    assert newer != older  # a dead job holds no key
    sem.execute("UPDATE {jobs} SET state = 'dead' WHERE id = %s", (newer,))

    with sem.connect() as conn:
        assert client.retry_jobs(conn, sem.schema, [older, newer]) == 2
    held = [keys_of(sem, job_id)[0] for job_id in (older, newer)]
    assert sorted(held, key=str) == sorted(['charge:{"order":7}', None], key=str)


def test_the_queued_scope_frees_the_key_when_the_job_starts(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()
    running = threading.Event()
    release = threading.Event()

    @sem.app.task(name="refresh", unique=True, unique_scope="queued", max_attempts=2, retry=AN_HOUR)
    def refresh(page: int) -> int:
        call = calls.record(page)
        if page == 2 and call == 1:
            raise ValueError("try again in an hour")
        if page == 1 and call == 1:
            running.set()
            release.wait(20)
        return call

    first = sem.enqueue(refresh, page=1)
    assert keys_of(sem, first) == (None, 'refresh:{"page":1}')
    waiting = sem.enqueue(refresh, page=1)
    assert waiting.duplicate and waiting == first

    workers(2)
    assert running.wait(15)
    # A retryable job started once: it holds no queued key any more.
    failed = sem.enqueue(refresh, page=2)
    sem.wait_for_state(failed, "retryable")
    after_failure = sem.enqueue(refresh, page=2)
    assert not after_failure.duplicate and after_failure != failed
    sem.wait_for_state(after_failure, "completed")

    # While the first runs, a new one is inserted and then holds the key itself. The
    # queue is paused so that it stays waiting.
    with sem.connect() as conn:
        client.set_queue_paused(conn, sem.schema, "default", paused=True)
    while_running = sem.enqueue(refresh, page=1)
    assert not while_running.duplicate and while_running != first
    assert sem.enqueue(refresh, page=1) == while_running

    with sem.connect() as conn:
        client.set_queue_paused(conn, sem.schema, "default", paused=False)
    release.set()
    assert sem.wait_for_state(first, "completed").result == 1
    assert sem.wait_for_state(while_running, "completed").result == 2
    assert sem.job(failed).state is skiplock.JobState.RETRYABLE


# -- jobs claimed ahead (decision 018) -----------------------------------------------


@dataclass
class ClaimedAhead:
    """One worker of one slot, held by a blocker, with a queued-unique job claimed ahead
    waiting at its gate (not given back: the test decides what happens to it)."""

    worker: WorkerThread
    refresh: skiplock.Task[int]
    first: int
    release: threading.Event
    runs: list[int]


def claimed_ahead(sem: Sem, workers: StartWorkers, monkeypatch: pytest.MonkeyPatch) -> ClaimedAhead:
    monkeypatch.setattr(producer, "GIVE_BACK_AFTER", 3600.0, raising=False)
    release = threading.Event()
    runs: list[int] = []
    running = threading.Event()

    @sem.app.task(name="blocker")
    def blocker() -> None:
        running.set()
        release.wait(20)

    @sem.app.task(name="refresh", unique=True, unique_scope="queued")
    def refresh(page: int) -> int:
        runs.append(page)
        return len(runs)

    _, first = sem.enqueue_many(
        [blocker.with_options(priority=0).job(), refresh.with_options(priority=1).job(page=1)]
    )
    (worker,) = workers(1, concurrency=1, prefetch=1)
    assert running.wait(15)
    wait_until(
        lambda: sem.execute("SELECT state FROM {jobs} WHERE id = %s", (first,)) == [("running",)],
        15.0,
        "the keyed job to be claimed ahead",
    )
    return ClaimedAhead(worker, refresh, first, release, runs)


def test_a_job_claimed_ahead_holds_its_queued_key_and_keeps_it_when_given_back(
    sem: Sem, workers: StartWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claimed ahead, the job has not started: a duplicate is refused. Given back
    unstarted (its worker stops), it is back in line with its key."""
    setup = claimed_ahead(sem, workers, monkeypatch)
    key = 'refresh:{"page":1}'
    try:
        again = sem.enqueue(setup.refresh, page=1)
        assert again.duplicate and int(again) == setup.first

        setup.worker.request_stop()
        sem.wait_for_state(setup.first, "available")
        assert keys_of(sem, setup.first) == (None, key)
        assert int(sem.enqueue(setup.refresh, page=1)) == setup.first
        assert sem.live_count() == 2  # the blocker and the one refresh
    finally:
        setup.release.set()
    setup.worker.join()
    assert setup.runs == []


def test_a_job_claimed_ahead_releases_its_queued_key_when_it_really_starts(
    sem: Sem, workers: StartWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = claimed_ahead(sem, workers, monkeypatch)
    setup.release.set()  # the slot frees: the job claimed ahead starts
    assert sem.wait_for_state(setup.first, "completed").result == 1
    later = sem.enqueue(setup.refresh, page=1)
    assert not later.duplicate
    assert sem.wait_for_state(int(later), "completed").result == 2


@pytest.mark.parametrize("when", ["scheduled", "available"])
def test_retrying_a_job_that_never_started_keeps_its_queued_key(
    sem: Sem, run_cli: RunCli, when: str
) -> None:
    """A retry moves a waiting job to now; it has not started, so its queued-scope key
    stays with it and a duplicate is still refused."""

    @sem.app.task(name="refresh", unique=True, unique_scope="queued")
    def refresh(page: int) -> None: ...

    soon = datetime.now(UTC) + timedelta(hours=1)
    later = refresh.with_options(run_at=soon) if when == "scheduled" else refresh
    first = int(sem.enqueue(later, page=1))
    key = 'refresh:{"page":1}'

    retried = run_cli("jobs", "retry", str(first))

    assert (retried.code, retried.err) == (0, "")
    assert keys_of(sem, first) == (None, key)
    again = sem.enqueue(refresh, page=1)
    assert again.duplicate and int(again) == first


# -- racing enqueues -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["threads", "asyncio"])
def test_racing_enqueues_of_one_key_insert_one_row_and_all_get_its_id(sem: Sem, how: str) -> None:
    @sem.app.task(name="rebuild")
    def rebuild(caller: int) -> None: ...

    callers = 12
    rounds = 4

    def race_threads(key: str) -> list[skiplock.JobRef]:
        start = threading.Barrier(callers)

        def enqueue(caller: int) -> skiplock.JobRef:
            with sem.connect(autocommit=False) as conn:
                conn.execute("SELECT 1")  # connected and in a transaction before the race
                start.wait(10)
                ref = rebuild.with_options(unique_key=key).enqueue(conn, caller=caller)
                conn.commit()
            return ref

        with ThreadPoolExecutor(callers) as pool:
            return list(pool.map(enqueue, range(callers)))

    async def race_asyncio(key: str) -> list[skiplock.JobRef]:
        conns = [await psycopg.AsyncConnection.connect(sem.url) for _ in range(callers)]

        async def enqueue(caller: int, conn: psycopg.AsyncConnection[Any]) -> skiplock.JobRef:
            ref = await rebuild.with_options(unique_key=key).enqueue_async(conn, caller=caller)
            await conn.commit()
            return ref

        try:
            return list(await asyncio.gather(*(enqueue(i, c) for i, c in enumerate(conns))))
        finally:
            for conn in conns:
                await conn.close()

    for round_number in range(rounds):
        key = f"rebuild:{round_number}"
        refs = race_threads(key) if how == "threads" else asyncio.run(race_asyncio(key))

        rows = sem.execute("SELECT id, args FROM {jobs} WHERE unique_key = %s", (key,))
        assert len(rows) == 1
        holder, args = rows[0]
        assert {int(ref) for ref in refs} == {holder}
        # Exactly one caller inserted, and the row is that caller's.
        assert [i for i, ref in enumerate(refs) if not ref.duplicate] == [args["caller"]]
    assert sem.live_count() == rounds


@pytest.mark.parametrize("holder_ends", ["rollback", "commit"])
def test_an_enqueue_behind_an_uncommitted_holder_waits_for_its_transaction(
    sem: Sem, holder_ends: str
) -> None:
    @sem.app.task(name="invoice", unique=True)
    def invoice(number: int) -> None: ...

    with sem.connect(autocommit=False) as holder, sem.connect(autocommit=False) as other:
        first = invoice.enqueue(holder, number=7)
        with ThreadPoolExecutor(1) as pool:

            def enqueue_and_commit() -> skiplock.JobRef:
                ref = invoice.enqueue(other, number=7)
                other.commit()
                return ref

            pending = pool.submit(enqueue_and_commit)
            pid = other.info.backend_pid
            wait_until(lambda: sem.waiting_on_lock(pid) or pending.done(), 10, "the wait")
            assert not pending.done(), "the second enqueue did not wait for the holder"
            if holder_ends == "rollback":
                holder.rollback()
            else:
                holder.commit()
            second = pending.result(timeout=10)

    rows = sem.execute("SELECT id FROM {jobs}")
    if holder_ends == "rollback":
        assert not second.duplicate and second != first
        assert rows == [(int(second),)]
    else:
        assert second.duplicate and second == first
        assert rows == [(int(first),)]


# -- in bulk ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_enqueue_many_maps_duplicates_to_their_holders_in_input_order(sem: Sem, mode: str) -> None:
    @sem.app.task(name="step")
    def step(n: int) -> None: ...

    @sem.app.task(name="report", unique=True)
    def report(day: int) -> None: ...

    live = sem.enqueue(step.with_options(unique_key="live"), n=-1)
    specs = [
        step.job(n=0),
        step.with_options(unique_key="a").job(n=1),
        step.job(n=2),
        step.with_options(unique_key="a").job(n=3),  # a duplicate within the batch
        step.with_options(unique_key="live").job(n=4),  # a duplicate of a live job
        step.with_options(unique_key="b", unique_scope="queued").job(n=5),
        step.with_options(unique_key="b", unique_scope="queued").job(n=6),
        report.job(day=1),
        step.job(n=8),
        report.job(day=1),
    ]
    # Position -> the position whose job holds its key (a position of its own if new).
    holder_of = {3: 1, 6: 5, 9: 7}

    if mode == "sync":
        ids = sem.enqueue_many(specs)
    else:

        async def enqueue_many() -> list[int]:
            async with await psycopg.AsyncConnection.connect(sem.url) as conn:
                found = await sem.app.enqueue_many_async(conn, specs)
                await conn.commit()
            return found

        ids = asyncio.run(enqueue_many())

    assert len(ids) == len(specs)
    assert ids[4] == live
    new_positions = [i for i in range(len(specs)) if i != 4 and i not in holder_of]
    assert len({ids[i] for i in new_positions}) == len(new_positions)
    for position, holder in holder_of.items():
        assert ids[position] == ids[holder]
    rows = {
        job_id: (task, args, key, queued_key)
        for job_id, task, args, key, queued_key in sem.execute(
            "SELECT id, task, args, unique_key, unique_queued_key FROM {jobs}"
        )
    }
    assert len(rows) == 1 + len(new_positions)
    for position in new_positions:
        spec = specs[position]
        task, args, key, queued_key = rows[ids[position]]
        assert (task, args) == (spec.task, json.loads(spec.args_json))
        assert (key, queued_key) == (
            (spec.unique_key, None) if spec.unique_scope == "active" else (None, spec.unique_key)
        )


def test_enqueue_many_keeps_the_scopes_of_one_key_apart(sem: Sem) -> None:
    @sem.app.task(name="step")
    def step(n: int) -> None: ...

    ids = sem.enqueue_many(
        [
            step.with_options(unique_key="k").job(n=1),
            step.with_options(unique_key="k", unique_scope="queued").job(n=2),
        ]
    )

    rows = dict(sem.execute("SELECT (args->>'n')::int, id FROM {jobs}"))
    assert ids == [rows[1], rows[2]]


def test_retrying_a_dead_transactional_job_with_a_queued_key_runs_it_without_the_key(
    sem: Sem, workers: StartWorkers
) -> None:
    @sem.app.task(
        name="import_feed", unique=True, unique_scope="queued", transactional=True, max_attempts=1
    )
    def import_feed(conn: psycopg.Connection[Any], feed: int) -> None:
        raise ValueError("feed unreachable")

    handles = workers(1)
    dead = sem.enqueue(import_feed, feed=3)
    sem.wait_for_state(dead, "dead")
    handles[0].stop()
    newer = sem.enqueue(import_feed, feed=3)
    assert not newer.duplicate

    with sem.connect() as conn:
        assert client.retry_jobs(conn, sem.schema, [dead]) == 1
    assert keys_of(sem, dead) == (None, None)
    assert keys_of(sem, newer) == (None, 'import_feed:{"feed":3}')


def test_under_several_workers_jobs_of_one_key_never_run_at_once(
    sem: Sem, workers: StartWorkers
) -> None:
    accounts = 6
    enqueuers = 4
    per_enqueuer = 40
    lock = threading.Lock()
    running: Counter[int] = Counter()
    overlaps: list[int] = []
    executed: Counter[int] = Counter()

    @sem.app.task(name="tally")
    def tally(account: int, seq: int) -> None:
        with lock:
            running[account] += 1
            if running[account] > 1:
                overlaps.append(account)
            executed[skiplock.current_job().id] += 1
        threading.Event().wait(0.002)  # a little work, so that jobs of a key overlap in time
        with lock:
            running[account] -= 1

    def enqueue(account: int, seq: int) -> skiplock.JobRef:
        return sem.enqueue(
            tally.with_options(unique_key=f"account:{account}"), account=account, seq=seq
        )

    # Before any worker runs, every second enqueue of a key is a duplicate.
    refs = [enqueue(account, seq) for seq in range(2) for account in range(accounts)]
    assert [ref.duplicate for ref in refs] == [False] * accounts + [True] * accounts

    workers(3)

    def enqueue_some(enqueuer: int) -> list[skiplock.JobRef]:
        rng = random.Random(enqueuer)
        return [enqueue(rng.randrange(accounts), seq) for seq in range(per_enqueuer)]

    with ThreadPoolExecutor(enqueuers) as pool:
        for batch in pool.map(enqueue_some, range(enqueuers)):
            refs.extend(batch)

    inserted = {int(ref) for ref in refs if not ref.duplicate}
    assert len(inserted) == sum(1 for ref in refs if not ref.duplicate)
    # Every duplicate was handed the id of a job some enqueue inserted.
    assert {int(ref) for ref in refs if ref.duplicate} <= inserted
    sem.wait_for_all(sorted(inserted), "completed")
    assert overlaps == []
    assert set(executed) == inserted
    assert set(executed.values()) == {1}
    assert sem.live_count() == 0


# -- time windows (0009) ---------------------------------------------------------------


def expire_windows(sem: Sem) -> None:
    """Move every window's end into the past, as if its time had passed."""
    sem.execute("UPDATE {unique_windows} SET expires_at = now() - interval '1 second'")


def test_a_window_refuses_duplicates_after_the_job_finished_until_it_passes(
    sem: Sem, workers: StartWorkers
) -> None:
    @sem.app.task(name="digest", unique=True, unique_window=3600)
    def digest(user: int) -> int:
        return user

    first = sem.enqueue(digest, user=1)
    assert sem.enqueue(digest, user=1) == first
    workers(1)
    sem.wait_for_state(first, "completed")

    # Finished, and still within its hour: the scope alone would let this in.
    again = sem.enqueue(digest, user=1)
    assert again.duplicate and again == first
    other = sem.enqueue(digest, user=2)
    assert not other.duplicate

    expire_windows(sem)
    fresh = sem.enqueue(digest, user=1)
    assert not fresh.duplicate and fresh != first
    assert sem.enqueue(digest, user=1) == fresh
    sem.wait_for_state(fresh, "completed")


def test_a_window_and_the_scope_both_hold(sem: Sem) -> None:
    @sem.app.task(name="report")
    def report(n: int) -> None: ...

    hourly = report.with_options(unique_key="report", unique_window=timedelta(hours=1))
    first = sem.enqueue(hourly, n=1)
    expire_windows(sem)
    # The window has passed but the first job still waits: the 'active' scope refuses,
    # and the window is not taken by a job that was never inserted.
    blocked = sem.enqueue(hourly, n=2)
    assert blocked.duplicate and blocked == first
    assert sem.execute("SELECT job_id FROM {unique_windows}") == []
    assert sem.live_count() == 1


def test_the_async_enqueue_honours_windows(sem: Sem) -> None:
    @sem.app.task(name="ping", unique=True, unique_window=60.0)
    def ping(n: int) -> None: ...

    async def enqueue_twice() -> list[skiplock.JobRef]:
        async with await psycopg.AsyncConnection.connect(sem.url, autocommit=True) as conn:
            return [await ping.enqueue_async(conn, n=1), await ping.enqueue_async(conn, n=1)]

    first, second = asyncio.run(enqueue_twice())
    assert not first.duplicate and second.duplicate and second == first


def test_enqueue_many_with_windows_maps_duplicates_in_order(sem: Sem) -> None:
    @sem.app.task(name="notify", unique=True, unique_window=60.0)
    def notify(user: int) -> None: ...

    held = sem.enqueue(notify, user=1)
    ids = sem.enqueue_many([notify.job(user=2), notify.job(user=1), notify.job(user=2)])
    assert ids[1] == held
    assert ids[0] == ids[2] != held
    assert sem.live_count() == 2


def test_racing_enqueues_of_one_windowed_key_insert_one_job(sem: Sem) -> None:
    @sem.app.task(name="rebuild_window")
    def rebuild(caller: int) -> None: ...

    callers = 8
    start = threading.Barrier(callers)
    windowed = rebuild.with_options(unique_key="rebuild", unique_window=60)

    def enqueue(caller: int) -> skiplock.JobRef:
        with sem.connect(autocommit=False) as conn:
            conn.execute("SELECT 1")
            start.wait(10)
            ref = windowed.enqueue(conn, caller=caller)
            conn.commit()
        return ref

    with ThreadPoolExecutor(callers) as pool:
        refs = list(pool.map(enqueue, range(callers)))
    rows = sem.execute("SELECT id FROM {jobs}")
    assert len(rows) == 1
    assert {int(ref) for ref in refs} == {rows[0][0]}
    assert sum(not ref.duplicate for ref in refs) == 1


def test_a_rolled_back_enqueue_leaves_the_window_free(sem: Sem) -> None:
    @sem.app.task(name="once", unique=True, unique_window=3600)
    def once(n: int) -> None: ...

    with sem.connect(autocommit=False) as conn:
        once.enqueue(conn, n=1)
        conn.rollback()
    ref = sem.enqueue(once, n=1)
    assert not ref.duplicate
    assert sem.live_count() == 1


def test_maintenance_deletes_windows_that_have_passed(sem: Sem) -> None:
    @sem.app.task(name="tick", unique=True, unique_window=3600)
    def tick(n: int) -> None: ...

    for n in range(3):
        sem.enqueue(tick, n=n)
    sem.execute(
        "UPDATE {unique_windows} SET expires_at = now() - interval '1 second' "
        "WHERE key LIKE '%%\"n\":0%%' OR key LIKE '%%\"n\":1%%'"
    )
    with sem.connect() as conn:
        report = history.maintain(conn, sem.schema, retention=None)
    assert report.expired_windows == 2
    assert len(sem.execute("SELECT key FROM {unique_windows}")) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_window": 60}, "unique_window needs unique=True or a unique key"),
        ({"unique": True, "unique_window": 0}, "unique_window must be a positive number"),
        ({"unique": True, "unique_window": "1h"}, "unique_window must be a positive number"),
        ({"unique": True, "unique_window": float("inf")}, "unique_window must be a positive"),
    ],
)
def test_bad_windows_fail_at_definition(sem: Sem, options: dict[str, Any], message: str) -> None:
    with pytest.raises(skiplock.ConfigurationError, match=message):

        @sem.app.task(name="bad_window", **options)
        def bad(n: int) -> None: ...


def test_a_per_call_window_needs_a_key(sem: Sem) -> None:
    @sem.app.task(name="keyless")
    def keyless(n: int) -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="unique_window needs a unique_key"):
        keyless.with_options(unique_window=60).job(n=1)
    with pytest.raises(skiplock.ConfigurationError, match="unique_window must be a positive"):
        keyless.with_options(unique_key="k", unique_window=-1)
