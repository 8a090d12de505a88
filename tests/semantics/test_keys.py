"""Keyed jobs: an ordering key runs its jobs one at a time in enqueue order, a
concurrency key at most its limit of them at once, oldest first; different keys run in
parallel.

A keyed job is inserted 'blocked' and the leader admits it (to available or scheduled)
when its key has room. An admitted job keeps its key's place through its retries and
gives it up when it completes, is cancelled or dies; a dead job retried by hand joins the
line again as the oldest.

The handlers write what they did into a ``Timeline`` (key, job number, attempt, start,
end on one monotonic clock); the checks are computed from it: each key's runs in order
and never overlapping, overlap per key up to and never past its limit.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from skiplock import client
from skiplock.retry import RetryPolicy

from .conftest import RunCli, Sem, StartWorkers
from .timeline import Run, Timeline, max_overlap

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

QUICK_RETRY = RetryPolicy(base=0.01, cap=0.01, jitter=0.0)
# Long enough for any wait in these tests on a loaded two-core machine.
PATIENCE = 30.0


def assert_one_at_a_time(runs: Sequence[Run]) -> None:
    """Each run (in start order) started after the one before it had ended."""
    for before, after in itertools.pairwise(runs):
        assert after.start > before.end, f"{after} started before {before} ended"


def state_counts(sem: Sem, queue: str = "default") -> dict[str, int]:
    with sem.connect() as conn:
        rows = client.queue_stats(conn, sem.schema)
    row = next((r for r in rows if r["queue"] == queue), None)
    assert row is not None, f"no stats for queue {queue!r}"
    return {state: int(row[state]) for state in ("blocked", "available", "running")}


def key_columns(sem: Sem, job_id: int) -> tuple[str, str | None, int]:
    rows = sem.execute("SELECT state, ordering_key, key_limit FROM {jobs} WHERE id = %s", (job_id,))
    assert rows, f"job {job_id} is not live"
    state, key, limit = rows[0]
    return str(state), key, int(limit)


# -- options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ordering_key": "a", "concurrency_key": "b"}, "ordering_key.*concurrency_key"),
        ({"ordering_key": "a", "concurrency_limit": 2}, "concurrency_limit"),
        ({"concurrency_limit": 2}, "concurrency_limit needs a concurrency_key"),
        ({"ordering_key": ""}, "ordering_key must be a non-empty string"),
        ({"ordering_key": "k" * 256}, "ordering_key must be .* at most 255"),
        ({"ordering_key": 42}, "ordering_key must be a non-empty string"),
        ({"concurrency_key": ""}, "concurrency_key must be a non-empty string"),
        ({"concurrency_key": "k" * 256, "concurrency_limit": 2}, "concurrency_key must be"),
        ({"concurrency_key": "k", "concurrency_limit": 0}, "concurrency_limit must be"),
        ({"concurrency_key": "k", "concurrency_limit": -3}, "concurrency_limit must be"),
        ({"concurrency_key": "k", "concurrency_limit": True}, "concurrency_limit must be"),
        ({"concurrency_key": "k", "concurrency_limit": 2.0}, "concurrency_limit must be"),
        ({"concurrency_key": "k", "concurrency_limit": "3"}, "concurrency_limit must be"),
        ({"concurrency_key": "k", "concurrency_limit": 32768}, "concurrency_limit .* 32767"),
    ],
)
def test_bad_key_options_fail_naming_the_option(
    sem: Sem, options: dict[str, Any], message: str
) -> None:
    @sem.app.task(name="sync_account")
    def sync_account() -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match=message):
        sync_account.with_options(**options)
    assert sem.live_count() == 0


def test_keys_at_their_bounds_are_stored_as_given(sem: Sem) -> None:
    @sem.app.task(name="sync_account")
    def sync_account() -> None: ...

    longest = "é" * 255  # characters, not bytes: the column's check agrees
    ordered = sem.enqueue(sync_account.with_options(ordering_key=longest))
    widest = sem.enqueue(sync_account.with_options(concurrency_key="k", concurrency_limit=32767))
    # Without a limit a concurrency key admits one at a time, as an ordering key does.
    single = sem.enqueue(sync_account.with_options(concurrency_key="single"))
    plain = sem.enqueue(sync_account)

    assert key_columns(sem, ordered) == ("blocked", longest, 1)
    assert key_columns(sem, widest) == ("blocked", "k", 32767)
    assert key_columns(sem, single) == ("blocked", "single", 1)
    assert key_columns(sem, plain) == ("available", None, 1)


def test_a_later_key_replaces_an_earlier_one_of_the_other_kind(sem: Sem) -> None:
    @sem.app.task(name="sync_account")
    def sync_account(n: int) -> None: ...

    ordered_then_limited = sync_account.with_options(ordering_key="a").with_options(
        concurrency_key="b", concurrency_limit=4
    )
    limited_then_ordered = sync_account.with_options(
        concurrency_key="b", concurrency_limit=4
    ).with_options(ordering_key="a")
    other_options_keep_the_key = sync_account.with_options(ordering_key="a").with_options(
        priority=3
    )

    spec = ordered_then_limited.job(n=1)
    assert (spec.ordering_key, spec.key_limit) == ("b", 4)
    spec = limited_then_ordered.job(n=2)
    assert (spec.ordering_key, spec.key_limit) == ("a", 1)
    spec = other_options_keep_the_key.job(n=3)
    assert (spec.ordering_key, spec.key_limit, spec.priority) == ("a", 1, 3)


# -- ordering --------------------------------------------------------------------------


def test_a_keys_jobs_run_one_at_a_time_in_enqueue_order_while_keys_run_in_parallel(
    sem: Sem, workers: StartWorkers
) -> None:
    keys = [f"customer:{k}" for k in range(6)]
    per_key = 8
    timeline = Timeline()
    firsts = threading.Barrier(len(keys))
    # (key, n) -> how many attempts fail: customer:1's job 2 once (then succeeds),
    # customer:2's job 2 every time (it goes dead after max_attempts).
    failing = {("customer:1", 2): 1, ("customer:2", 2): 3}

    @sem.app.task(name="bill", max_attempts=3, retry=QUICK_RETRY)
    def bill(key: str, n: int) -> None:
        with timeline.run(key, n) as attempt:
            if n == 0:
                # Every key's first job waits for all the others: unless keys run in
                # parallel, the barrier breaks and the test fails.
                firsts.wait(PATIENCE)
            threading.Event().wait(0.005)  # a little work, so that runs could overlap
            if attempt <= failing.get((key, n), 0):
                raise ValueError(f"{key} job {n}: upstream down on attempt {attempt}")

    workers(3)

    def enqueue_line(key: str) -> list[int]:
        call = bill.with_options(ordering_key=key)
        return [int(sem.enqueue(call, key=key, n=n)) for n in range(per_key)]

    # One enqueuer per key, all at once; each key's jobs in order within its enqueuer.
    with ThreadPoolExecutor(len(keys)) as pool:
        ids = dict(zip(keys, pool.map(enqueue_line, keys), strict=True))

    dead = ids["customer:2"][2]
    sem.wait_for_state(dead, "dead", timeout=PATIENCE)
    completed = [job_id for key in keys for job_id in ids[key] if job_id != dead]
    sem.wait_for_all(completed, "completed", timeout=PATIENCE)

    for key in keys:
        runs = timeline.runs(key)
        expected = [
            (n, attempt)
            for n in range(per_key)
            for attempt in range(1, min(failing.get((key, n), 0) + 1, 3) + 1)
        ]
        # Enqueue order, each failing job's retries before the next job's first run
        # (customer:1), and a dead job letting the line move on (customer:2).
        assert [(r.n, r.attempt) for r in runs] == expected, key
        assert_one_at_a_time(runs)

    # The database agrees: each job of a key was claimed after the one before it was
    # (one clock: the server's). Not "after it finished": attempted_at and finished_at
    # are each their transaction's start (now()), and a claim's transaction may begin
    # before the completion that releases its job commits, then see it in its snapshot
    # (0.55 ms apart, seen on a loaded machine); that no two of a key's jobs ran at once
    # is the handlers' own record, checked above.
    claimed_at = dict(
        sem.execute("SELECT id, attempted_at FROM {history} WHERE id = ANY(%s)", (completed,))
    )
    for key in keys:
        line = [job_id for job_id in ids[key] if job_id != dead]
        for before, after in itertools.pairwise(line):
            assert claimed_at[after] >= claimed_at[before], (key, before, after)

    everything = timeline.runs()
    assert any(a.key != b.key and a.overlaps(b) for a, b in itertools.combinations(everything, 2))
    assert max_overlap(everything) >= len(keys)
    assert sem.live_count() == 1  # the dead job


def test_retrying_a_dead_keyed_job_puts_it_back_in_line_first(
    sem: Sem, workers: StartWorkers, run_cli: RunCli
) -> None:
    timeline = Timeline()
    hold = threading.Event()
    tries: dict[int, int] = {}

    @sem.app.task(name="ship", max_attempts=1)
    def ship(n: int) -> None:
        with timeline.run("order:9", n):
            tries[n] = tries.get(n, 0) + 1
            if n == 0 and tries[n] == 1:
                raise ValueError("carrier refused the parcel")
            if n == 1:
                hold.wait(PATIENCE)  # keeps the key while job 0 is retried

    call = ship.with_options(ordering_key="order:9")
    workers(2)
    first = sem.enqueue(call, n=0)
    sem.wait_for_state(first, "dead", timeout=PATIENCE)
    # The dead job gave the key up: the next job of the line runs.
    holding = sem.enqueue(call, n=1)
    sem.wait_for_state(holding, "running", timeout=PATIENCE)
    behind = sem.enqueue(call, n=2)
    assert key_columns(sem, behind)[0] == "blocked"

    retried = run_cli("jobs", "retry", str(first))

    assert (retried.code, retried.err) == (0, "")
    assert key_columns(sem, first) == ("blocked", "order:9", 1)
    assert state_counts(sem) == {"blocked": 2, "available": 0, "running": 1}
    hold.set()
    sem.wait_for_all([first, holding, behind], "completed", timeout=PATIENCE)
    runs = timeline.runs("order:9")
    # The retried job, the oldest in line, ran before the one enqueued after it.
    assert [(r.n, r.attempt) for r in runs] == [(0, 1), (1, 1), (0, 1), (2, 1)]
    assert_one_at_a_time(runs)


def test_enqueue_many_puts_keyed_jobs_in_line_beside_plain_ones(
    sem: Sem, workers: StartWorkers
) -> None:
    timeline = Timeline()

    @sem.app.task(name="post")
    def post(key: str, n: int) -> None:
        with timeline.run(key, n):
            threading.Event().wait(0.002)

    keys = ["feed:a", "feed:b", "feed:c"]

    def batch() -> list[skiplock.JobSpec]:
        return [
            spec
            for n in range(6)
            for spec in (
                *(post.with_options(ordering_key=key).job(key=key, n=n) for key in keys),
                post.with_options(concurrency_key="pool", concurrency_limit=2).job(key="pool", n=n),
                post.job(key="plain", n=n),
            )
        ]

    # Without unique keys enqueue_many writes with COPY; with one it takes its other path.
    copied = batch()
    inserted = [
        *batch(),
        post.with_options(ordering_key="feed:a", unique_key="u").job(key="feed:a", n=6),
    ]
    ids = sem.enqueue_many(copied) + sem.enqueue_many(inserted)

    rows = {
        job_id: (str(state), key, int(limit))
        for job_id, state, key, limit in sem.execute(
            "SELECT id, state, ordering_key, key_limit FROM {jobs} WHERE id = ANY(%s)", (ids,)
        )
    }
    for job_id, spec in zip(ids, copied + inserted, strict=True):
        if spec.ordering_key is None:
            assert rows[job_id] == ("available", None, 1)
        else:
            assert rows[job_id] == ("blocked", spec.ordering_key, spec.key_limit)

    workers(3)
    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    for key in keys:
        runs = timeline.runs(key)
        # The first batch's jobs of a key, then the second's, each in order.
        tail = [6] if key == "feed:a" else []
        assert [r.n for r in runs] == [*range(6), *range(6), *tail], key
        assert_one_at_a_time(runs)
    assert max_overlap(timeline.runs("pool")) <= 2


def test_the_async_enqueues_put_keyed_jobs_in_line_too(sem: Sem) -> None:
    @sem.app.task(name="post")
    def post(n: int) -> None: ...

    async def enqueue() -> list[int]:
        async with await psycopg.AsyncConnection.connect(sem.url) as conn:
            one = await post.with_options(ordering_key="feed:a").enqueue_async(conn, n=0)
            many = await sem.app.enqueue_many_async(
                conn,
                [
                    post.with_options(concurrency_key="pool", concurrency_limit=3).job(n=1),
                    post.job(n=2),
                    post.with_options(ordering_key="feed:a").job(n=3),
                ],
            )
            await conn.commit()
        return [int(one), *many]

    ids = asyncio.run(enqueue())

    assert [key_columns(sem, job_id) for job_id in ids] == [
        ("blocked", "feed:a", 1),
        ("blocked", "pool", 3),
        ("available", None, 1),
        ("blocked", "feed:a", 1),
    ]


def test_a_batch_of_many_keys_is_admitted_in_one_pass(sem: Sem, workers: StartWorkers) -> None:
    """Past 100 keys in one statement the insert asks for a full admission pass."""
    timeline = Timeline()

    @sem.app.task(name="touch")
    def touch(key: str, n: int) -> None:
        with timeline.run(key, n):
            pass

    workers(3)
    keys = [f"device:{k}" for k in range(150)]
    ids = sem.enqueue_many(
        [touch.with_options(ordering_key=key).job(key=key, n=n) for n in range(2) for key in keys]
    )

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    for key in keys:
        runs = timeline.runs(key)
        assert [r.n for r in runs] == [0, 1], key
        assert_one_at_a_time(runs)


def test_transactional_keyed_jobs_run_one_at_a_time_in_order(
    sem: Sem, workers: StartWorkers
) -> None:
    timeline = Timeline()

    @sem.app.task(name="ledger", transactional=True)
    def ledger(conn: psycopg.Connection[Any], key: str, n: int) -> None:
        with timeline.run(key, n):
            conn.execute("SELECT 1")
            threading.Event().wait(0.005)

    keys = ["account:1", "account:2", "account:3"]
    ids = [
        int(sem.enqueue(ledger.with_options(ordering_key=key), key=key, n=n))
        for n in range(5)
        for key in keys
    ]
    workers(2)

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    for key in keys:
        runs = timeline.runs(key)
        assert [r.n for r in runs] == list(range(5)), key
        assert_one_at_a_time(runs)


def test_a_new_leader_admits_when_the_old_one_stops(sem: Sem, workers: StartWorkers) -> None:
    timeline = Timeline()

    @sem.app.task(name="greet")
    def greet(key: str, n: int) -> None:
        with timeline.run(key, n):
            pass

    handles = workers(2)

    def leader() -> Any:
        rows = sem.execute("SELECT worker_id FROM {leader} WHERE expires_at > now()")
        return rows[0][0] if rows else None

    wait_until(lambda: leader() is not None, PATIENCE, "a leader")
    first_leader = leader()
    elected = next(h for h in handles if h.worker.id == first_leader)
    elected.stop()
    ids = [
        int(sem.enqueue(greet.with_options(ordering_key="guest"), key="guest", n=n))
        for n in range(3)
    ]

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    assert [r.n for r in timeline.runs("guest")] == [0, 1, 2]
    assert leader() not in (None, first_leader)


# -- concurrency keys ------------------------------------------------------------------


def test_a_concurrency_key_runs_up_to_its_limit_at_once_oldest_first(
    sem: Sem, workers: StartWorkers
) -> None:
    limits = {"tenant:a": 3, "tenant:b": 2}
    per_key = {"tenant:a": 12, "tenant:b": 8}
    timeline = Timeline()
    # The first `limit` jobs of a key wait for each other: they must all be admitted at
    # once, or the barrier breaks and the test fails.
    barriers = {key: threading.Barrier(limit) for key, limit in limits.items()}

    @sem.app.task(name="export")
    def export(key: str, n: int) -> None:
        with timeline.run(key, n):
            if n < limits[key]:
                barriers[key].wait(PATIENCE)
            threading.Event().wait(0.01)

    workers(3)
    ids = [
        int(
            sem.enqueue(
                export.with_options(concurrency_key=key, concurrency_limit=limits[key]),
                key=key,
                n=n,
            )
        )
        for key in limits
        for n in range(per_key[key])
    ]

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    for key, limit in limits.items():
        runs = timeline.runs(key)
        assert sorted(r.n for r in runs) == list(range(per_key[key]))
        # A limit, not a serialisation: reached, and never passed.
        assert max_overlap(runs) == limit, key
        # Oldest first: job n was admitted when fewer than `limit` older jobs were still
        # admitted, so at its start at least n - limit + 1 older ones had ended.
        ends = {r.n: r.end for r in runs}
        for run in runs:
            ended = sum(1 for older in range(run.n) if ends[older] < run.start)
            assert ended >= run.n - limit + 1, (key, run.n, ended)


# -- watching and steering -------------------------------------------------------------


def test_status_counts_jobs_waiting_for_their_key(
    sem: Sem, workers: StartWorkers, run_cli: RunCli
) -> None:
    release = threading.Event()
    started: list[int] = []

    @sem.app.task(name="reindex")
    def reindex(n: int) -> None:
        started.append(n)
        release.wait(PATIENCE)

    ids = [int(sem.enqueue(reindex.with_options(ordering_key="index:7"), n=n)) for n in range(3)]

    assert state_counts(sem) == {"blocked": 3, "available": 0, "running": 0}
    status = run_cli("status")
    assert status.out.splitlines()[0].split()[:4] == ["queue", "waiting", "blocked", "available"]
    row = next(line.split() for line in status.out.splitlines() if line.startswith("default"))
    assert row[1:6] == ["0", "3", "0", "0", "0"]  # waiting, blocked, available, scheduled, running
    listed = run_cli("jobs", "list", "--state", "blocked")
    assert [int(line.split()[0]) for line in listed.out.splitlines()[1:]] == ids

    workers(1)  # alone, so the leader: it admits the oldest job of the key
    sem.wait_for_state(ids[0], "running", timeout=PATIENCE)
    assert state_counts(sem) == {"blocked": 2, "available": 0, "running": 1}
    release.set()
    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    assert started == [0, 1, 2]
    assert state_counts(sem) == {"blocked": 0, "available": 0, "running": 0}


def test_cancelling_a_waiting_keyed_job_takes_it_out_of_line_at_once(
    sem: Sem, workers: StartWorkers
) -> None:
    timeline = Timeline()

    @sem.app.task(name="refund")
    def refund(n: int) -> str:
        with timeline.run("order:5", n):
            if n == 0:
                # Runs until cancelled.
                wait_until(skiplock.cancel_requested, PATIENCE, "the cancellation")
            return f"refunded {n}"

    call = refund.with_options(ordering_key="order:5")
    first, second, third = (int(sem.enqueue(call, n=n)) for n in range(3))
    workers(2)
    sem.wait_for_state(first, "running", timeout=PATIENCE)

    with sem.connect() as conn:
        client.cancel_job(conn, sem.schema, second)

    gone = sem.job(second)
    assert (gone.state, gone.attempts, gone.finished_at is not None) == (
        skiplock.JobState.CANCELLED,
        0,
        True,
    )
    assert sem.execute("SELECT ordering_key FROM {history} WHERE id = %s", (second,)) == [
        ("order:5",)
    ]
    assert key_columns(sem, third)[0] == "blocked"

    # Cancelling the running job gives its key up too: the line moves on.
    with sem.connect() as conn:
        client.cancel_job(conn, sem.schema, first)
    sem.wait_for_state(first, "cancelled", timeout=PATIENCE)
    assert sem.wait_for_state(third, "completed", timeout=PATIENCE).result == "refunded 2"
    runs = timeline.runs("order:5")
    assert [r.n for r in runs] == [0, 2]
    assert_one_at_a_time(runs)


@pytest.mark.parametrize("then", ["run it now", "cancel it", "delete it"])
def test_a_keyed_job_due_later_holds_its_place_until_it_leaves(
    sem: Sem, workers: StartWorkers, then: str
) -> None:
    timeline = Timeline()

    @sem.app.task(name="remind")
    def remind(n: int) -> None:
        with timeline.run("user:3", n):
            pass

    later = int(sem.enqueue(remind.with_options(ordering_key="user:3", delay=3600), n=0))
    after = int(sem.enqueue(remind.with_options(ordering_key="user:3"), n=1))
    workers(1)

    # Admitted, it waits for its time as 'scheduled', and the key stays taken.
    sem.wait_for_state(later, "scheduled", timeout=PATIENCE)
    assert key_columns(sem, after)[0] == "blocked"
    with sem.connect() as conn:
        if then == "run it now":
            client.retry_job(conn, sem.schema, later)
        elif then == "cancel it":
            client.cancel_job(conn, sem.schema, later)
        else:
            client.delete_job(conn, sem.schema, later)

    sem.wait_for_state(after, "completed", timeout=PATIENCE)
    expected = [0, 1] if then == "run it now" else [1]
    assert [r.n for r in timeline.runs("user:3")] == expected


def test_a_snoozed_keyed_job_keeps_its_place(sem: Sem, workers: StartWorkers) -> None:
    timeline = Timeline()
    snoozed: set[int] = set()

    @sem.app.task(name="poll_carrier")
    def poll_carrier(n: int) -> str:
        with timeline.run("parcel:8", n):
            if n == 0 and n not in snoozed:
                snoozed.add(n)
                raise skiplock.Snooze(0.05)
            return f"polled {n}"

    call = poll_carrier.with_options(ordering_key="parcel:8")
    ids = [int(sem.enqueue(call, n=n)) for n in range(3)]
    workers(2)

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    runs = timeline.runs("parcel:8")
    assert [r.n for r in runs] == [0, 0, 1, 2]
    assert_one_at_a_time(runs)


def test_the_leader_admits_keyed_jobs_of_queues_it_does_not_work(
    sem: Sem, workers: StartWorkers
) -> None:
    timeline = Timeline()

    @sem.app.task(name="print_label", queue="labels")
    def print_label(n: int) -> None:
        with timeline.run("printer:1", n):
            pass

    (elsewhere,) = workers(1, queues=["other"])
    wait_until(
        lambda: sem.execute("SELECT worker_id FROM {leader}") == [(elsewhere.worker.id,)],
        PATIENCE,
        "the worker of queue 'other' to lead",
    )
    workers(1, queues=["labels"])
    call = print_label.with_options(ordering_key="printer:1")
    ids = [int(sem.enqueue(call, n=n)) for n in range(3)]

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    assert [r.n for r in timeline.runs("printer:1")] == [0, 1, 2]
    assert sem.execute("SELECT worker_id FROM {leader}") == [(elsewhere.worker.id,)]
