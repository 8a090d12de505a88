"""Claim-ahead sized from job durations (decision 018): short jobs are claimed in batches
larger than the worker's concurrency, which still caps the handlers running at once; long
jobs are not claimed ahead, so an idle worker next to a busy one gets them.

The sizing rule is pure (``ahead_target``) and tested as such; the rest with real workers
on a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import StartWorker, WorkerThread, wait_until
from skiplock.config import notify_channel
from skiplock.tasks import TaskCall
from skiplock.worker import producer
from skiplock.worker.leased import LeasedJobs
from skiplock.worker.producer import ClaimAhead, Slots, ahead_target


def test_nothing_is_claimed_ahead_before_a_job_and_a_claim_were_timed() -> None:
    assert ahead_target(4, 100, None, 0.001) == 0
    assert ahead_target(4, 100, 0.001, None) == 0


def test_short_jobs_are_claimed_ahead_to_cover_a_claims_round_trip_twice() -> None:
    # 4 slots finish 4 / 50 us jobs a second; a 1 ms claim needs 80 of them, twice over.
    assert ahead_target(4, 1000, 50e-6, 0.001) == 160
    assert ahead_target(4, 100, 50e-6, 0.001) == 100  # capped
    # One slot, 5 ms jobs, 0.5 ms claims (the lesson's seed): one job ahead.
    assert ahead_target(1, 100, 0.005, 0.0005) == 1


def test_jobs_long_beside_a_claim_are_not_claimed_ahead() -> None:
    assert ahead_target(1, 100, 0.1, 0.0005) == 0
    assert ahead_target(10, 100, 1.0, 0.002) == 0
    assert ahead_target(10, 0, 50e-6, 0.001) == 0  # turned off


def test_claim_ahead_resizes_the_slots_and_a_fixed_prefetch_stays_put() -> None:
    slots = Slots(4)
    ahead = ClaimAhead(slots, 4, most=100)
    assert (slots.total, slots.free) == (4, 4)
    slots.take(3)
    ahead.job_ended(50e-6)
    ahead.claimed(0.001)
    assert ahead.target == 100
    assert (slots.total, slots.free) == (104, 101)
    for _ in range(50):
        ahead.job_ended(1.0)  # the jobs got long
    ahead.claimed(0.001)
    assert ahead.target == 0
    assert (slots.total, slots.free) == (4, 1)

    fixed = ClaimAhead(Slots(2), 2, most=100, fixed=3)
    fixed.job_ended(50e-6)
    fixed.claimed(0.001)
    assert fixed.target == 3 and fixed.slots.total == 5


def test_slots_stuck_on_long_jobs_claim_nothing_ahead_and_the_bound_caps_the_target() -> None:
    # 4 slots, 50 us jobs, 1 ms claims: 160 wanted; with 3 stuck, the one turning slot's.
    assert ahead_target(4, 1000, 50e-6, 0.001, stuck=3) == 40
    assert ahead_target(4, 1000, 50e-6, 0.001, stuck=4) == 0
    assert ahead_target(2, 100, None, None, stuck=2, fixed=6) == 0
    assert ahead_target(2, 100, None, None, stuck=1, fixed=6) == 3  # a pinned number shrinks
    # No more than the turning slots start within the bound: 2 slots, 20 ms jobs, 50 ms.
    assert ahead_target(2, 100, 0.02, 0.001, fixed=40, bound=0.05) == 5
    assert ahead_target(1, 100, 0.06, 0.01, bound=0.05) == 0  # one would wait 60 ms
    assert ahead_target(1, 100, 0.06, 0.01, fixed=3, bound=0.05) == 0


def test_after_a_give_back_nothing_is_claimed_ahead_until_a_job_ends() -> None:
    slots = Slots(1)
    ahead = ClaimAhead(slots, 1, most=100)
    ahead.job_ended(50e-6)
    ahead.claimed(0.001)
    assert ahead.target == 40 and slots.total == 41
    ahead.hold_off()
    ahead.claimed(0.001)
    assert ahead.target == 0 and slots.total == 1
    ahead.job_ended(50e-6)
    ahead.adjust()
    assert ahead.target > 0
    assert ahead.wait_bound() == producer.GIVE_BACK_AFTER  # 2 x 1 ms claims is less
    ahead.claimed(1.0)
    assert ahead.wait_bound() > producer.GIVE_BACK_AFTER


class Overlap:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.done = 0

    def __enter__(self) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.running -= 1
            self.done += 1


@pytest.mark.parametrize("concurrency", [1, 4])
def test_short_jobs_come_in_batches_and_concurrency_still_caps_what_runs(
    app: skiplock.App, start_worker: StartWorker, concurrency: int
) -> None:
    overlap = Overlap()

    @app.task(name="short")
    async def short(n: int) -> None:
        with overlap:
            await asyncio.sleep(0)

    jobs = 2000
    with psycopg.connect(app.database_url) as conn:
        app.enqueue_many(conn, [short.job(n=n) for n in range(jobs)])
    handle = start_worker(app, concurrency=concurrency)  # the default: prefetch sized

    wait_until(lambda: overlap.done == jobs, 60.0, "every job to run")
    stats = handle.worker.stats
    assert overlap.most <= concurrency
    assert stats.largest_claim > 2 * concurrency, stats
    assert stats.claims < jobs / (2 * concurrency), stats


def test_long_jobs_are_not_claimed_ahead_and_an_idle_worker_gets_its_share(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    ran: list[int] = []

    @app.task(name="long")
    def long(n: int) -> None:
        ran.append(n)
        threading.Event().wait(0.3)

    first = start_worker(app, concurrency=1)
    second = start_worker(app, concurrency=1)
    with psycopg.connect(app.database_url) as conn:
        app.enqueue_many(conn, [long.job(n=n) for n in range(6)])
    wait_until(lambda: len(ran) == 6, 30.0, "every job to run")

    for handle in (first, second):
        stats = handle.worker.stats
        assert stats.largest_claim == 1, stats  # one job per free slot, none ahead
        assert 2 <= stats.claimed <= 4, stats  # each worker ran its share


def give_back(app: skiplock.App, job_id: int | None = None) -> list[int]:
    """What a rescuer does to the jobs of a worker it found dead (``job_id``'s, or every
    running one): back to available, never started, with the wake-up that carries each
    one's position (a rescue rewinds claim cursors)."""
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        rows = conn.execute(
            f"UPDATE {app.schema}.jobs SET state = 'available', worker_id = NULL, "
            "lease_expires_at = NULL, claimed_ahead = false, attempts = attempts - 1 "
            "WHERE state = 'running' AND (%(id)s::bigint IS NULL OR id = %(id)s) RETURNING id",
            {"id": job_id},
        ).fetchall()
        ids = [int(row[0]) for row in rows]
        conn.execute(
            "SELECT pg_notify(%s, queue || E'\\t' || priority || E'\\t' "
            f"|| extract(epoch FROM run_at)) FROM {app.schema}.jobs WHERE id = ANY(%s)",
            (notify_channel(app.schema), ids),
        )
    return ids


@dataclass
class OneWaiting:
    """A worker of one slot held by a blocker job, with one job claimed ahead waiting at
    the gate for that slot; ``release`` frees it, ``ran`` records the waiting job's runs."""

    handle: WorkerThread
    jobs: LeasedJobs
    waiting_id: int
    release: threading.Event
    ran: list[str]


def one_waiting(
    app: skiplock.App, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> OneWaiting:
    """The job waits as long as the test needs: not given back after GIVE_BACK_AFTER."""
    monkeypatch.setattr(producer, "GIVE_BACK_AFTER", 3600.0, raising=False)
    release = threading.Event()
    ran: list[str] = []

    @app.task(name="blocker")
    def blocker() -> None:
        release.wait(30)

    @app.task(name="waiting")
    def waiting() -> None:
        ran.append("waiting")

    with psycopg.connect(app.database_url) as conn:
        app.enqueue_many(
            conn, [blocker.with_options(priority=0).job(), waiting.with_options(priority=1).job()]
        )
    handle = start_worker(app, concurrency=1, prefetch=1)
    assert handle.worker.parts is not None
    jobs = handle.worker.parts.jobs
    held = jobs.running_jobs
    wait_until(lambda: len(held) == 2 and len(held.waiting()) == 1, 30.0, "both claimed")
    (waiting_id,) = held.waiting()
    return OneWaiting(handle, jobs, waiting_id, release, ran)


def test_a_job_claimed_ahead_and_given_back_while_it_waited_does_not_start(
    app: skiplock.App, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker cut off from the database is found dead and its jobs given back, while a
    job it claimed ahead waits for a slot. When a slot frees, that job must not start on
    a claim that is no longer the worker's (tests/cluster saw it run twice)."""
    setup = one_waiting(app, start_worker, monkeypatch)
    jobs = setup.jobs
    # As after a silence: the next start reads its claim first.
    jobs.confirm_after = 0.0
    assert give_back(app, setup.waiting_id) == [setup.waiting_id]

    setup.release.set()  # the slot frees; the job given back is claimed again and runs once
    wait_until(lambda: setup.ran == ["waiting"], 30.0, "the job given back to run")
    wait_until(lambda: not jobs.running_jobs, 30.0, "the worker to finish")
    assert setup.ran == ["waiting"]
    assert setup.handle.worker.stats.lost_leases == 1


class _HeldAnswers:
    """The worker's claim pool, with the answer of the claim that brings ``job_id`` held
    back after its commit (the claim's rows read late, as over a slow link) until
    ``release`` is set; ``holding`` is set while it is held."""

    def __init__(self, pool: Any, job_id: int) -> None:
        self._connection = pool.connection
        self.job_id = job_id
        self.holding = threading.Event()
        self.release = threading.Event()

    @contextlib.asynccontextmanager
    async def connection(self, *args: Any, **kwargs: Any) -> Any:
        async with self._connection(*args, **kwargs) as conn:
            yield _HeldConnection(conn, self)


class _HeldConnection:
    def __init__(self, conn: Any, held: _HeldAnswers) -> None:
        self._conn, self._held = conn, held

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        cur = await self._conn.execute(query, params, **kwargs)
        if "SKIP LOCKED" not in str(query):
            return cur
        rows = await cur.fetchall()  # committed: the claim's transaction has ended
        if any(row[0] == self._held.job_id for row in rows):
            self._held.holding.set()
            while not self._held.release.is_set():
                await asyncio.sleep(0.01)
        return _Answered(rows)


class _Answered:
    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    async def fetchall(self) -> list[Any]:
        return self._rows


def test_a_job_given_back_and_claimed_again_before_its_wait_ends_starts_once(
    app: skiplock.App, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job claimed ahead is given back, and this worker claims it again (the same
    attempt number) while the stale entry asks whether its claim still holds: the row
    answers yes, but the new claim's answer is not read yet. The stale entry must wait
    for claims in flight before it starts, or the job runs twice (seen once in CI:
    ['waiting', 'waiting'])."""
    setup = one_waiting(app, start_worker, monkeypatch)
    jobs = setup.jobs
    jobs.confirm_after = 0.0
    parts = setup.handle.worker.parts
    assert parts is not None and jobs.starts is not None
    held = _HeldAnswers(parts.pools.claims, setup.waiting_id)
    monkeypatch.setattr(parts.pools.claims, "connection", held.connection)
    asked = jobs.starts.still_claimed

    async def still_claimed(job_id: int, attempt: int) -> bool:
        while not held.holding.is_set():  # the new claim has committed, unread
            await asyncio.sleep(0.01)
        answer = await asked(job_id, attempt)
        threading.Timer(0.3, held.release.set).start()
        return answer

    monkeypatch.setattr(jobs.starts, "still_claimed", still_claimed)
    assert give_back(app, setup.waiting_id) == [setup.waiting_id]

    setup.release.set()
    wait_until(lambda: setup.ran == ["waiting"], 30.0, "the job given back to run")
    wait_until(lambda: not jobs.running_jobs, 30.0, "the worker to finish")
    assert setup.ran == ["waiting"]
    assert setup.handle.worker.stats.lost_leases == 1


def test_a_job_given_back_while_it_ran_and_claimed_again_is_completed_by_the_new_claim(
    app: skiplock.App, start_worker: StartWorker
) -> None:
    """A job given back while its handler ran (its lease found expired) can be claimed
    again by the same worker under the same attempt number, which the fence cannot tell
    apart: the outcome written must be the new claim's, never the stale run's."""
    releases = [threading.Event(), threading.Event()]
    runs: list[int] = []
    ended: list[int] = []

    @app.task(name="slow")
    def slow() -> int:
        runs.append(len(runs) + 1)
        run = len(runs)
        releases[run - 1].wait(30)
        ended.append(run)
        return run

    with psycopg.connect(app.database_url) as conn:
        (job_id,) = app.enqueue_many(conn, [slow.job()])
    handle = start_worker(app, concurrency=2, prefetch=0)
    wait_until(lambda: runs == [1], 30.0, "the first run to start")
    # What a rescuer does to a job whose lease ran out, with its wake-up.
    assert give_back(app, job_id) == [job_id]
    wait_until(lambda: runs == [1, 2], 30.0, "the job claimed again by the same worker")
    releases[0].set()  # the stale run ends first, while the new claim holds the job
    wait_until(lambda: ended == [1], 30.0, "the stale run to end")
    releases[1].set()

    def finished() -> object:
        with psycopg.connect(app.database_url) as conn:
            row = conn.execute(
                f"SELECT result FROM {app.schema}.job_history WHERE id = %s", (job_id,)
            ).fetchone()
        return None if row is None else row[0]

    wait_until(lambda: finished() is not None, 30.0, "the job to be completed")
    assert finished() == 2  # the new claim's run, not the stale one's
    assert handle.worker.stats.lost_leases == 1


def test_a_claim_answered_late_is_read_again_before_its_jobs_start(
    app: skiplock.App, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker stops (SIGSTOP, a stalled link) after the server ran its claim and before
    it reads the answer; meanwhile the job is given back, as a rescuer does. The answer,
    read late, is as old as the claim: the job must be checked before it starts, not
    started on it (tests/cluster's frozen host saw such a job run twice). Here the answer
    is held back by blocking the worker's event loop, as a stopped process is."""
    ran: list[int] = []

    @app.task(name="once")
    def once() -> None:
        ran.append(1)

    handle = start_worker(app, concurrency=1, prefetch=1)
    wait_until(lambda: handle.worker.parts is not None, 30.0, "the worker to start")
    assert handle.worker.parts is not None
    jobs = handle.worker.parts.jobs
    jobs.confirm_after = 0.2
    armed = threading.Event()
    fetchall = psycopg.AsyncCursor.fetchall

    async def late(cursor: psycopg.AsyncCursor[object]) -> list[object]:
        rows = await fetchall(cursor)
        claim = rows and isinstance(rows[0], tuple) and len(rows[0]) >= 6
        if armed.is_set() and claim and (cursor.statusmessage or "").startswith("UPDATE"):
            armed.clear()
            give_back(app)
            time.sleep(2 * jobs.confirm_after)  # the loop stands still: nothing else runs
        return rows

    monkeypatch.setattr(psycopg.AsyncCursor, "fetchall", late)
    armed.set()
    with psycopg.connect(app.database_url) as conn:
        (job_id,) = app.enqueue_many(conn, [once.job()])
    wait_until(lambda: not armed.is_set(), 30.0, "the claim to be answered late")

    def completed() -> bool:
        with psycopg.connect(app.database_url, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {app.schema}.job_history WHERE id = %s", (job_id,)
            ).fetchone()
        return row is not None and row[0] == 1

    # Given back, it is claimed again (the worker's poll) and runs once.
    wait_until(completed, 30.0, "the job given back to run")
    wait_until(lambda: not jobs.running_jobs, 30.0, "the worker to finish")
    assert ran == [1]


def test_a_confirmation_answered_late_is_asked_again(
    app: skiplock.App, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that waited for a slot after a silence reads its claim before it starts. If
    the worker stops while that read's yes is on its way, the yes is stale when read: the
    job may have been given back meanwhile. It is asked again, not taken at its word."""
    setup = one_waiting(app, start_worker, monkeypatch)
    jobs, waiting_id = setup.jobs, setup.waiting_id
    assert jobs.starts is not None
    jobs.confirm_after = 0.0  # every start after a wait reads its claim first
    jobs.late_answer = 0.3
    answered = jobs.starts.still_claimed
    late = threading.Event()

    async def still_claimed_late(job_id: int, attempt: int) -> bool:
        ours = await answered(job_id, attempt)
        if job_id == waiting_id and not late.is_set():
            late.set()
            # Given back, as a rescuer does, while the loop stands still (a stopped
            # worker) with the yes in hand.
            assert give_back(app, job_id) == [job_id]
            time.sleep(2 * jobs.late_answer)
        return ours

    monkeypatch.setattr(jobs.starts, "still_claimed", still_claimed_late)
    setup.release.set()
    wait_until(late.is_set, 30.0, "the confirmation answered late")
    wait_until(lambda: setup.ran == ["waiting"], 30.0, "the job given back to run")
    wait_until(lambda: not jobs.running_jobs, 30.0, "the worker to finish")
    assert setup.ran == ["waiting"]


# -- claim-ahead costs nothing when jobs differ (issue 20) ------------------------------


def finished_rows(app: skiplock.App, ids: list[int]) -> dict[int, tuple[datetime, list[str]]]:
    """Finished jobs among ``ids``: when each finished, and the workers that claimed it."""
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT id, finished_at, worker_ids FROM {app.schema}.job_history WHERE id = ANY(%s)",
            (ids,),
        ).fetchall()
    return {int(r[0]): (r[1], [str(w) for w in r[2]]) for r in rows}


def warm_up(app: skiplock.App, handle: WorkerThread, short: TaskCall[None]) -> None:
    """Run short jobs on the worker (their queue is its alone) until it claims ahead: it
    has timed its jobs and claims."""
    with psycopg.connect(app.database_url) as conn:
        warm = app.enqueue_many(conn, [short.job(n=n) for n in range(300)])
    wait_until(lambda: len(finished_rows(app, warm)) == len(warm), 60.0, "the warm-up")
    ahead = handle.worker.parts.ahead if handle.worker.parts is not None else None
    assert ahead is not None
    assert ahead.target > 0, (ahead.job_seconds, ahead.claim_seconds)


@pytest.mark.parametrize("prefetch", [40, None], ids=["fixed", "auto"])
def test_short_jobs_claimed_ahead_behind_a_long_one_go_to_the_idle_worker(
    app: skiplock.App, start_worker: StartWorker, prefetch: int | None
) -> None:
    """Two workers of one slot each: a long job and then 30 short ones are claimed by one
    of them at once. The short ones must not wait behind the long one there while the
    other worker has a free slot: given back, they are run by the other, before the long
    job ends. The idle worker polls and probes only every 30 s: it claims them because the
    give-back woke it."""
    long_started = threading.Event()
    long_may_end = threading.Event()

    @app.task(name="long")
    def long() -> None:
        long_started.set()
        long_may_end.wait(6.0)

    @app.task(name="short")
    def short(n: int) -> None:
        pass

    quiet = {"poll_interval": 30.0, "sweep_interval": 30.0}
    first = start_worker(app, queues=["default", "warm-1"], concurrency=1, prefetch=prefetch)
    second = start_worker(
        app, queues=["default", "warm-2"], concurrency=1, prefetch=prefetch, **quiet
    )
    for handle, queue in ((first, "warm-1"), (second, "warm-2")):
        warm_up(app, handle, short.with_options(queue=queue))

    with psycopg.connect(app.database_url) as conn:
        (long_id, *short_ids) = app.enqueue_many(
            conn,
            [long.with_options(priority=0).job()]
            + [short.with_options(priority=1).job(n=n) for n in range(30)],
        )
    assert long_started.wait(30.0)

    def shorts_done_or_long_ended() -> bool:
        return len(finished_rows(app, short_ids)) == 30 or long_id in finished_rows(app, [long_id])

    wait_until(shorts_done_or_long_ended, 30.0, "the short jobs or the long one to end")
    long_may_end.set()
    wait_until(lambda: len(finished_rows(app, [long_id, *short_ids])) == 31, 30.0, "every job")

    rows = finished_rows(app, [long_id, *short_ids])
    long_end, (holder,) = rows[long_id][0], rows[long_id][1]
    other = str((second if holder == str(first.worker.id) else first).worker.id)
    late = [job_id for job_id in short_ids if rows[job_id][0] >= long_end]
    assert late == [], f"{len(late)} short jobs finished after the long job"
    assert all(rows[job_id][1][-1] == other for job_id in short_ids)


def test_a_stopping_worker_gives_its_waiting_jobs_back_while_its_running_job_runs(
    app: skiplock.App, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked to stop, a worker gives back the jobs waiting at its gate at once, not after
    its running jobs end (up to the shutdown timeout, unheartbeated meanwhile): back to
    available, the attempt not counted, and another worker runs them meanwhile."""
    setup = one_waiting(app, start_worker, monkeypatch)
    setup.handle.request_stop()

    def given_back() -> bool:
        with psycopg.connect(app.database_url, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT state, attempts, worker_id, claimed_ahead, errors "
                f"FROM {app.schema}.jobs WHERE id = %s",
                (setup.waiting_id,),
            ).fetchone()
        return (
            row is not None
            and row[:4] == ("available", 0, None, False)
            and [(e["type"], e["attempt"]) for e in row[4]] == [("WorkerShutdown", 1)]
        )

    try:
        wait_until(given_back, 10.0, "the job claimed ahead to be given back")
        other = start_worker(app, concurrency=1, prefetch=0)
        wait_until(
            lambda: finished_rows(app, [setup.waiting_id]), 30.0, "the other worker to run it"
        )
        assert setup.handle.alive  # still running its blocker
        assert setup.ran == ["waiting"]
        assert finished_rows(app, [setup.waiting_id])[setup.waiting_id][1][-1] == str(
            other.worker.id
        )
    finally:
        setup.release.set()
    setup.handle.join()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_running_job_is_not_marked_claimed_ahead_for_long(
    app: skiplock.App, start_worker: StartWorker, prefetch: int
) -> None:
    """Rescue must charge a job that started. Without prefetch no claim is marked; with
    it, a claim asking for more jobs than it has run permits is, and the start of a job
    that runs is recorded a moment after it starts (decision 015)."""
    running = threading.Event()
    release = threading.Event()

    @app.task(name="runs")
    def runs() -> None:
        running.set()
        release.wait(30)

    start_worker(app, concurrency=1, prefetch=prefetch)
    try:
        with psycopg.connect(app.database_url) as conn:
            (job_id,) = app.enqueue_many(conn, [runs.job()])
        assert running.wait(30)

        def row() -> object:
            with psycopg.connect(app.database_url, autocommit=True) as conn:
                return conn.execute(
                    f"SELECT state, claimed_ahead FROM {app.schema}.jobs WHERE id = %s",
                    (job_id,),
                ).fetchone()

        if prefetch:
            wait_until(lambda: row() == ("running", False), 10.0, "its start to be recorded")
        assert row() == ("running", False)
    finally:
        release.set()
