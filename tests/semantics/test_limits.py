"""Queue limits, across all workers: at most ``concurrency`` lease-mode jobs of a queue
running at once, and at most ``rate`` = (jobs, seconds) started in any window of the
period (a sliding window: jobs over it wait their turn, they never fail).

Limited queues claim in a transaction that takes turns on the queue's row. The handlers
write their runs into a ``Timeline`` (one monotonic clock) and the checks are computed
from it: overlap never past the limit and reaching it, starts per window never past the
rate.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from skiplock import client
from skiplock.tasks import parse_rate
from skiplock.worker import limits as limits_module
from skiplock.worker import producer
from skiplock.worker.limits import QueueLimits

from .conftest import RunCli, Sem, StartWorkers
from .timeline import Timeline, WindowLog, max_overlap, most_starts_within

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

# Long enough for any wait in these tests on a loaded two-core machine.
PATIENCE = 30.0


def set_limits(
    sem: Sem, queue: str, *, concurrency: int | None = None, rate: tuple[int, float] | None = None
) -> None:
    with sem.connect() as conn:
        client.set_queue_limits(conn, sem.schema, queue, concurrency=concurrency, rate=rate)


def limits_of(sem: Sem) -> dict[str, tuple[Any, ...]]:
    with sem.connect() as conn:
        rows = client.list_queues(conn, sem.schema)
    return {
        row["name"]: (row["concurrency_limit"], row["rate_limit"], row["rate_period"])
        for row in rows
    }


def running_count(sem: Sem, queue: str) -> int:
    rows = sem.execute(
        "SELECT count(*) FROM {jobs} WHERE queue = %s AND state = 'running'", (queue,)
    )
    return int(rows[0][0])


# -- rates as text ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("100/s", (100, 1.0)),
        ("10/5s", (10, 5.0)),
        ("600/minute", (600, 60.0)),
        ("600/1m", (600, 60.0)),
        ("600/min", (600, 60.0)),
        ("1000/hour", (1000, 3600.0)),
        ("1000/h", (1000, 3600.0)),
        ("5/day", (5, 86400.0)),
        ("2/secs", (2, 1.0)),
        ("3/0.5s", (3, 0.5)),
        (" 7 / 2 seconds ", (7, 2.0)),
        ("2147483647/s", (2**31 - 1, 1.0)),
    ],
)
def test_parse_rate_reads_jobs_per_period(text: str, rate: tuple[int, float]) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize(
    "text",
    [
        "",
        "100",
        "100/",
        "/s",
        "fast",
        "0/s",
        "-1/s",
        "1.5/s",
        "10/0s",
        "10/week",
        "10/1.2.3s",
        "2147483648/s",
        "10/.s",
        "1/100000000000d",
    ],
)
def test_parse_rate_refuses_what_is_not_a_rate(text: str) -> None:
    with pytest.raises(skiplock.ConfigurationError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": -2}, "concurrency"),
        ({"concurrency": 2.5}, "concurrency"),
        ({"concurrency": "3"}, "concurrency"),
        ({"concurrency": 2**31}, "concurrency"),
        ({"rate": (0, 1.0)}, "rate"),
        ({"rate": (5, 0.0)}, "rate"),
        ({"rate": (5, -1.0)}, "rate"),
        ({"rate": (5, float("nan"))}, "rate"),
        ({"concurrency": True}, "concurrency"),
        ({"rate": (1.5, 1.0)}, "rate"),
        ({"rate": (2**31, 1.0)}, "rate"),
        ({"rate": (5, float("inf"))}, "rate"),
    ],
)
def test_bad_queue_limits_fail_naming_the_limit(
    sem: Sem, limits: dict[str, Any], message: str
) -> None:
    with sem.connect() as conn, pytest.raises(skiplock.ConfigurationError, match=message):
        client.set_queue_limits(conn, sem.schema, "mail", **limits)
    assert limits_of(sem) == {}


def test_set_queue_limits_takes_a_rate_as_text_too(sem: Sem) -> None:
    with sem.connect() as conn:
        client.set_queue_limits(conn, sem.schema, "mail", rate="600/minute")
        client.set_queue_limits(conn, sem.schema, "sms", concurrency=2, rate=(3, 0.5))
        with pytest.raises(skiplock.ConfigurationError, match="rate 'often'"):
            client.set_queue_limits(conn, sem.schema, "push", rate="often")

    assert limits_of(sem) == {"mail": (None, 600, 60.0), "sms": (2, 3, 0.5)}


# -- the command line ------------------------------------------------------------------


def test_queues_limit_sets_shows_and_removes_limits(sem: Sem, run_cli: RunCli) -> None:
    both = run_cli("queues", "limit", "mail", "--concurrency", "3", "--rate", "100/s")
    rate_only = run_cli("queues", "limit", "sms", "--rate", "600/minute")
    paused = run_cli("queues", "pause", "push")

    assert (both.code, both.out, both.err) == (
        0,
        "queue mail: at most 3 running, at most 100 started per 1s\n",
        "",
    )
    assert rate_only.out == "queue sms: at most 600 started per 60s\n"
    assert paused.code == 0
    assert limits_of(sem) == {
        "mail": (3, 100, 1.0),
        "sms": (None, 600, 60.0),
        "push": (None, None, None),
    }
    listed = run_cli("queues", "list")
    assert listed.code == 0
    assert listed_queues(listed.out) == {
        "mail": ("active", "at most 3 running, at most 100 started per 1s"),
        "push": ("paused", "-"),
        "sms": ("active", "at most 600 started per 60s"),
    }

    # A new limit replaces both; no options remove them.
    changed = run_cli("queues", "limit", "mail", "--concurrency", "5")
    removed = run_cli("queues", "limit", "sms")

    assert changed.out == "queue mail: at most 5 running\n"
    assert removed.out == "queue sms: no limits\n"
    assert limits_of(sem)["mail"] == (5, None, None)
    assert limits_of(sem)["sms"] == (None, None, None)
    assert listed_queues(run_cli("queues", "list").out) == {
        "mail": ("active", "at most 5 running"),
        "push": ("paused", "-"),
        "sms": ("active", "-"),
    }


def listed_queues(out: str) -> dict[str, tuple[str, str]]:
    """``queues list``: each queue's state and limits columns."""
    rows = [line.split(None, 6) for line in out.splitlines()[1:]]
    return {row[0]: (row[1], row[6]) for row in rows}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--rate", "fast"), "rate 'fast'"),
        (("--rate", "0/s"), "rate '0/s'"),
        (("--concurrency", "0"), "concurrency"),
        (("--rate", "1/100000000000d"), "rate '1/100000000000d'"),
        (("--rate", "5/.s"), "rate '5/.s'"),
    ],
)
def test_queues_limit_refuses_bad_limits(
    sem: Sem, run_cli: RunCli, options: tuple[str, ...], message: str
) -> None:
    result = run_cli("queues", "limit", "mail", *options)

    assert result.code == 2
    assert message in result.err
    assert result.out == ""
    assert limits_of(sem) == {}


# -- concurrency -----------------------------------------------------------------------


def test_a_queue_concurrency_limit_holds_across_workers_and_is_reached(
    sem: Sem, workers: StartWorkers
) -> None:
    limit = 3
    timeline = Timeline()
    # The first `limit` jobs of the limited queue wait for each other, and all the jobs of
    # the other queue do too: each barrier breaks (and the test fails) unless that many
    # run at once.
    limited_together = threading.Barrier(limit)
    free_jobs = 6
    free_together = threading.Barrier(free_jobs)

    @sem.app.task(name="render")
    def render(queue: str, n: int) -> None:
        with timeline.run(queue, n):
            if queue == "limited" and n < limit:
                limited_together.wait(PATIENCE)
            if queue == "free":
                free_together.wait(PATIENCE)
            threading.Event().wait(0.01)  # a little work, so that runs overlap

    set_limits(sem, "limited", concurrency=limit)
    # Claiming ahead, as by default: a job claimed ahead by a worker whose slots all hold
    # jobs waiting at their barrier is given back within the bound, so the barrier fills
    # (before decision 018's revision, CI saw it break once).
    workers(3, queues=["limited", "free"], prefetch=2)
    ids = [
        int(sem.enqueue(render.with_options(queue=queue), queue=queue, n=n))
        for queue, count in (("limited", 24), ("free", free_jobs))
        for n in range(count)
    ]

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    assert max_overlap(timeline.runs("limited")) == limit
    assert max_overlap(timeline.runs("free")) == free_jobs  # other queues are not held back
    assert sorted(r.n for r in timeline.runs("limited")) == list(range(24))
    assert sem.live_count() == 0


@pytest.mark.parametrize("how", ["removed", "raised"])
def test_a_lifted_concurrency_limit_lets_waiting_jobs_run(
    sem: Sem, workers: StartWorkers, run_cli: RunCli, how: str
) -> None:
    timeline = Timeline()
    together = threading.Barrier(4)

    @sem.app.task(name="resize")
    def resize(n: int) -> None:
        with timeline.run("images", n):
            together.wait(PATIENCE)  # all four at once: only once the limit is lifted

    set_limits(sem, "images", concurrency=1)
    workers(3, queues=["images"])
    ids = [int(sem.enqueue(resize.with_options(queue="images"), n=n)) for n in range(4)]
    wait_until(lambda: running_count(sem, "images") == 1, PATIENCE, "one job running")
    assert running_count(sem, "images") == 1

    if how == "removed":
        set_limits(sem, "images")
    else:
        assert run_cli("queues", "limit", "images", "--concurrency", "4").code == 0

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    assert max_overlap(timeline.runs("images")) == 4


def test_a_limit_set_while_workers_run_holds_for_jobs_enqueued_after_it(
    sem: Sem, workers: StartWorkers
) -> None:
    timeline = Timeline()

    @sem.app.task(name="crawl")
    def crawl(n: int) -> None:
        with timeline.run("crawl", n):
            threading.Event().wait(0.2)  # long enough for all of them to be claimed at once

    # Maintenance ticks every 10 s (lease_seconds 30 / 3): rare, as a quiet deployment
    # may have them; the limit must not wait for one.
    workers(3, queues=["crawl"], rescue_interval=10.0)
    set_limits(sem, "crawl", concurrency=2)
    ids = sem.enqueue_many([crawl.with_options(queue="crawl").job(n=n) for n in range(8)])

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    assert max_overlap(timeline.runs("crawl")) <= 2


@pytest.mark.parametrize("limit", ["concurrency", "rate", "transactional rate"])
def test_a_limit_written_without_its_message_still_holds(
    sem: Sem, workers: StartWorkers, limit: str
) -> None:
    """The 'limits' message only makes workers read the limits sooner: a claim that runs
    before it arrives (or when it is lost, or the row was written by hand) must not take
    more than the limit allows."""
    timeline = Timeline()

    if limit == "transactional rate":
        # A worker's transactional sessions serve the queue the task names.
        @sem.app.task(name="crawl", queue="crawl", transactional=True)
        def crawl_in(conn: psycopg.Connection[Any], n: int) -> None:
            with timeline.run("crawl", n):
                conn.execute("SELECT pg_sleep(0.2)")

        job = crawl_in.job
    else:

        @sem.app.task(name="crawl")
        def crawl(n: int) -> None:
            with timeline.run("crawl", n):
                threading.Event().wait(0.2)

        job = crawl.with_options(queue="crawl").job

    workers(3, queues=["crawl"], rescue_interval=10.0)
    sem.execute(
        "INSERT INTO {queues} (name, concurrency_limit, rate_limit, rate_period) "
        "VALUES ('crawl', %s, %s, %s)",
        (2, None, None) if limit == "concurrency" else (None, 2, 60.0),
    )
    ids = sem.enqueue_many([job(n=n) for n in range(8)])

    if limit == "concurrency":
        sem.wait_for_all(ids, "completed", timeout=PATIENCE)
        assert max_overlap(timeline.runs("crawl")) <= 2
    else:
        # Two starts a minute: two run, the rest wait for the window.
        wait_until(lambda: len(timeline.runs("crawl")) >= 2, PATIENCE, "two jobs of the rate ran")
        time.sleep(limits_module.REFRESH_SECONDS + 1.0)  # a re-read of the limits, and more
        assert len(timeline.runs("crawl")) == 2


# -- rate ------------------------------------------------------------------------------


def test_a_queue_rate_limit_spreads_starts_over_a_sliding_window(
    sem: Sem, workers: StartWorkers
) -> None:
    jobs, period = 10, 1.0
    total = 30
    timeline = Timeline()

    @sem.app.task(name="call_api")
    async def call_api(n: int) -> None:
        with timeline.run("api", n):
            await asyncio.sleep(0)

    set_limits(sem, "api", rate=(jobs, period))
    workers(3, queues=["api"])
    # What the rate holds are the claims' times in its window (the database's clock);
    # the handlers start after them, later on a loaded machine (see WindowLog).
    with WindowLog(lambda: sem.execute("SELECT name, rate_window FROM {queues}")) as log:
        ids = sem.enqueue_many([call_api.with_options(queue="api").job(n=n) for n in range(total)])
        sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    starts = [r.start for r in timeline.runs("api")]
    assert len(starts) == total
    counted = log.times("api")
    assert len(counted) >= total, counted
    assert most_starts_within(counted, period) <= jobs, counted
    # 30 claims at 10 per second: at least two periods from the first to the last.
    assert counted[-1] - counted[0] >= 2 * period
    # Over the rate, jobs wait; none failed for it.
    attempts = sem.execute("SELECT attempts, errors FROM {history} WHERE id = ANY(%s)", (ids,))
    assert attempts == [(1, [])] * total


def test_a_queue_with_both_limits_keeps_both(sem: Sem, workers: StartWorkers) -> None:
    jobs, period, limit = 6, 0.5, 2
    timeline = Timeline()
    together = threading.Barrier(limit)

    @sem.app.task(name="sync_crm")
    def sync_crm(n: int) -> None:
        with timeline.run("crm", n):
            if n < limit:
                together.wait(PATIENCE)
            threading.Event().wait(0.02)

    set_limits(sem, "crm", concurrency=limit, rate=(jobs, period))
    workers(3, queues=["crm"])
    # The rate counts claims on the database's clock (its rate_window); the handlers'
    # starts follow a little later, later still on a loaded machine, so two windows'
    # starts may bunch up: the window's own times are what must hold it.
    with WindowLog(lambda: sem.execute("SELECT name, rate_window FROM {queues}")) as log:
        ids = sem.enqueue_many([sync_crm.with_options(queue="crm").job(n=n) for n in range(18)])
        sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    runs = timeline.runs("crm")
    assert len(runs) == 18
    assert max_overlap(runs) == limit
    counted = log.times("crm")
    assert len(counted) >= 18, counted
    assert most_starts_within(counted, period) <= jobs, counted


def test_a_queue_rate_limit_holds_for_transactional_jobs(sem: Sem, workers: StartWorkers) -> None:
    jobs, period = 5, 1.0
    timeline = Timeline()

    @sem.app.task(name="post_entry", queue="ledger", transactional=True)
    def post_entry(conn: psycopg.Connection[Any], n: int) -> None:
        with timeline.run("ledger", n):
            conn.execute("SELECT 1")

    set_limits(sem, "ledger", rate=(jobs, period))
    workers(2, queues=["ledger"])
    # The rate counts what the sessions reserve, before they claim (a reservation left
    # unused is lost): the reservations hold it exactly, the starts follow them.
    with WindowLog(lambda: sem.execute("SELECT name, rate_window FROM {queues}")) as log:
        ids = sem.enqueue_many([post_entry.job(n=n) for n in range(3 * jobs)])
        sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    reserved = log.times("ledger")
    assert len(reserved) >= 3 * jobs, reserved
    assert most_starts_within(reserved, period) <= jobs, reserved
    starts = [r.start for r in timeline.runs("ledger")]
    assert len(starts) == 3 * jobs
    # 15 starts at 5 a second: at least two periods from the first reservation to the last.
    assert reserved[-1] - reserved[0] >= 2 * period


# -- jobs claimed ahead (decision 018) ---------------------------------------------------


@pytest.mark.parametrize("limited", ["before", "after"])
def test_jobs_claimed_ahead_never_hold_a_limited_queue_back(
    sem: Sem, workers: StartWorkers, monkeypatch: pytest.MonkeyPatch, limited: str
) -> None:
    """A worker of one slot, busy with a long job, that claims ahead. ``before``: the
    queue is limited to 4 before its jobs come; that worker must not claim them (it cannot
    start them), and an idle worker runs 4 at once. ``after``: the busy worker claimed 4
    ahead while the queue was unlimited, and then the limit came; those 4 wait at its gate
    unstarted and must not count against the limit: the idle worker runs 4 more at once.
    (The bound after which the busy worker gives jobs back is lifted here: what is tested
    is the limit's count, not the give-back.)"""
    monkeypatch.setattr(producer, "GIVE_BACK_AFTER", 3600.0, raising=False)
    limit = 4
    timeline = Timeline()
    together = threading.Barrier(limit)
    blocking = threading.Event()
    release = threading.Event()

    @sem.app.task(name="blocker", queue="other")
    def blocker() -> None:
        blocking.set()
        release.wait(PATIENCE)

    @sem.app.task(name="limited", queue="limited")
    def limited_job(n: int) -> None:
        with timeline.run("limited", n):
            if n < limit:
                together.wait(PATIENCE / 2)

    if limited == "before":
        set_limits(sem, "limited", concurrency=limit)
    (busy,) = workers(1, queues=["other", "limited"], concurrency=1, prefetch=8)
    sem.enqueue(blocker)
    assert blocking.wait(PATIENCE)
    # Each lease claim of the busy worker asks once whether its queue is limited.
    fetches: list[str] = []
    assert busy.worker.parts is not None
    limits = busy.worker.parts.limits
    governs = QueueLimits.__contains__

    def counted(self: QueueLimits, queue: str) -> bool:
        if self is limits:
            fetches.append(queue)
        return governs(self, queue)

    monkeypatch.setattr(QueueLimits, "__contains__", counted)
    if limited == "after":
        early = sem.enqueue_many([limited_job.job(n=limit + n) for n in range(limit)])
        wait_until(
            lambda: (
                sem.execute(
                    "SELECT count(*) FROM {jobs} WHERE id = ANY(%s) AND state = 'running'", (early,)
                )
                == [(limit,)]
            ),
            PATIENCE,
            "the busy worker to claim 4 ahead",
        )
        set_limits(sem, "limited", concurrency=limit)
        wait_until(lambda: "limited" in limits.governed, PATIENCE, "the limit to be read")
    mark = len(fetches)
    ids = sem.enqueue_many([limited_job.job(n=n) for n in range(limit)])
    # The busy worker's claims of the queue since: the second starts after the first ended.
    wait_until(
        lambda: fetches[mark:].count("limited") >= 2,
        PATIENCE,
        "the busy worker to try the limited queue",
    )
    (idle,) = workers(1, queues=["limited"], concurrency=limit, prefetch=0)
    try:
        sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    finally:
        release.set()
    runs = [r for r in timeline.runs("limited") if r.n < limit]
    assert max_overlap(runs) == limit
    claimers = sem.execute(
        "SELECT DISTINCT unnest(worker_ids)::text FROM {history} WHERE id = ANY(%s)", (ids,)
    )
    assert claimers == [(str(idle.worker.id),)]
