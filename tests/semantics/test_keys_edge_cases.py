"""Keys, uniqueness and windows under the conditions that used to poison them (issue 10,
items 7 to 10): waiting jobs of one key with different limits, an ordering key and a
concurrency key sharing a name, a keyed job under a 'queued' unique key, a window re-taken
while maintenance prunes it, and a holder leaving its scope in the middle of a bulk
enqueue.

The admission statement is run here as the leader runs it (ADMIT, for the keys asked about
or for every waiting key), and then through real workers. The interleavings are made
deterministic by holding a transaction open (a row lock the other side must wait on) or
by acting at the moment PostgreSQL reports a statement's progress (a NOTICE raised by a
trigger on the jobs table, received while the statement is still being read).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import wait_until
from skiplock import client, history
from skiplock.sql import keys, render
from skiplock.tasks import TaskCall

from .conftest import Sem, StartWorkers
from .timeline import Run, Timeline

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

PATIENCE = 30.0


def admit(sem: Sem, asked: Sequence[str] | None = None) -> int:
    """One admission as the leader runs it (every waiting key when none is asked about), one
    transaction. Returns how many jobs it admitted."""
    with sem.connect() as conn:
        if asked is None:
            asked = [row[0] for row in conn.execute(render(keys.KEYS_WAITING, sem.schema))]
        rows = conn.execute(render(keys.ADMIT, sem.schema), {"keys": list(asked)}).fetchall()
    return sum(int(row[1]) for row in rows)


def states(sem: Sem, ids: Sequence[int]) -> list[str | None]:
    found = dict(sem.execute("SELECT id, state FROM {jobs} WHERE id = ANY(%s)", (list(ids),)))
    return [found.get(job_id) for job_id in ids]


def finish(sem: Sem, *ids: int) -> None:
    """The admitted jobs leave their key as a completion would: the row goes. Without the
    admission that a completion's trigger runs (0015): the admission under test here is
    the leader's call that follows."""
    with sem.connect() as conn:
        conn.execute("SET session_replication_role = replica")  # no triggers
        deleted = conn.execute(
            render("DELETE FROM {jobs} WHERE id = ANY(%s) RETURNING id", sem.schema),
            (list(ids),),
        ).fetchall()
    assert deleted


def never_more_than_its_own_limit(runs: Sequence[Run], limits: dict[int, int]) -> None:
    """While a job ran, at most its own key limit of its key's jobs ran (itself included)."""
    for run in runs:
        alongside = [other for other in runs if other is not run and other.overlaps(run)]
        assert len(alongside) + 1 <= limits[run.n], f"{run} ran beside {alongside}"


# -- 7: one key's mixed limits -----------------------------------------------------------


def test_waiting_jobs_of_one_key_with_different_limits_are_admitted_each_within_its_own(
    sem: Sem,
) -> None:
    """A deploy changed concurrency_limit from 3 to 1 while jobs waited: the job of limit 3
    is admitted, the ones of limit 1 wait for a key of their own, one at a time, and the
    other key is admitted in the same pass (it used to fail with them, on jobs_key_single)."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    wide = sync.with_options(concurrency_key="k", concurrency_limit=3)
    narrow = sync.with_options(concurrency_key="k", concurrency_limit=1)
    first = int(sem.enqueue(wide, n=0))
    second, third = int(sem.enqueue(narrow, n=1)), int(sem.enqueue(narrow, n=2))
    other = int(sem.enqueue(sync.with_options(ordering_key="other"), n=3))
    line = [first, second, third, other]

    assert admit(sem) == 2
    assert states(sem, line) == ["available", "blocked", "blocked", "available"]
    assert admit(sem, ["k"]) == 0  # the limit-3 job still holds the key

    finish(sem, first)
    assert admit(sem, ["k"]) == 1
    assert states(sem, [second, third]) == ["available", "blocked"]
    finish(sem, second)
    assert admit(sem) == 1
    assert states(sem, [third]) == ["available"]


def test_a_limit_raised_while_a_job_of_the_lower_limit_runs_waits_for_it(sem: Sem) -> None:
    """Every admitted job's own limit holds: a job of limit 1 runs alone even when the
    jobs behind it (limit 3) would have room by their own count."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    alone = int(sem.enqueue(sync.with_options(concurrency_key="k"), n=0))
    assert admit(sem) == 1
    wide = sync.with_options(concurrency_key="k", concurrency_limit=3)
    behind = [int(sem.enqueue(wide, n=n)) for n in (1, 2, 3, 4)]

    assert admit(sem) == 0
    finish(sem, alone)
    assert admit(sem) == 3
    assert states(sem, behind) == ["available", "available", "available", "blocked"]


def test_an_ordering_key_and_a_concurrency_key_of_one_name_never_stop_other_keys(
    sem: Sem,
) -> None:
    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    limited = sync.with_options(concurrency_key="k", concurrency_limit=3)
    ordered = sync.with_options(ordering_key="k")
    line = [
        int(sem.enqueue(limited, n=0)),
        int(sem.enqueue(ordered, n=1)),
        int(sem.enqueue(ordered, n=2)),
        int(sem.enqueue(limited, n=3)),
        int(sem.enqueue(limited, n=4)),
    ]
    others = [int(sem.enqueue(sync.with_options(ordering_key=f"o{n}"), n=n)) for n in range(3)]

    assert admit(sem) == 1 + len(others)
    assert states(sem, others) == ["available"] * len(others)
    expected = [
        ["available", "blocked", "blocked", "blocked", "blocked"],
        [None, "available", "blocked", "blocked", "blocked"],
        [None, None, "available", "blocked", "blocked"],
        [None, None, None, "available", "available"],
    ]
    assert states(sem, line) == expected[0]
    for step, after in enumerate(expected[1:]):
        finish(sem, line[step])
        admit(sem, ["k"])
        assert states(sem, line) == after


def test_workers_run_a_key_of_mixed_limits_and_every_other_key(
    sem: Sem, workers: StartWorkers
) -> None:
    timeline = Timeline()

    @sem.app.task(name="sync")
    def sync(key: str, n: int) -> None:
        with timeline.run(key, n):
            threading.Event().wait(0.02)  # long enough for runs to overlap if allowed

    limits = {0: 3, 1: 1, 2: 1, 3: 3, 4: 3, 5: 1}
    ids = []
    for n, limit in limits.items():
        options = (
            {"ordering_key": "k"}
            if n == 5
            else {"concurrency_key": "k", "concurrency_limit": limit}
        )
        ids.append(int(sem.enqueue(sync.with_options(**options), key="k", n=n)))
    others = [
        int(sem.enqueue(sync.with_options(ordering_key=f"o{n}"), key=f"o{n}", n=n))
        for n in range(4)
    ]
    workers(2, concurrency=6)

    sem.wait_for_all(others, "completed", timeout=PATIENCE)
    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    runs = timeline.runs("k")
    assert sorted(run.n for run in runs) == list(limits)
    never_more_than_its_own_limit(runs, limits)


# -- 8: 'queued' unique keys of keyed jobs -----------------------------------------------


def test_a_waiting_keyed_job_holds_its_queued_unique_key(sem: Sem) -> None:
    @sem.app.task(name="report")
    def report(n: int) -> None: ...

    keyed = report.with_options(ordering_key="a", unique_key="u", unique_scope="queued")
    first = sem.enqueue(keyed, n=1)
    again = sem.enqueue(keyed, n=2)
    other_key = sem.enqueue(
        report.with_options(ordering_key="b", unique_key="u", unique_scope="queued"), n=3
    )
    plain = sem.enqueue(report.with_options(unique_key="u", unique_scope="queued"), n=4)
    in_bulk = sem.enqueue_many([keyed.job(n=5), report.with_options(ordering_key="c").job(n=6)])

    assert not first.duplicate
    assert (again.duplicate, other_key.duplicate, plain.duplicate) == (True, True, True)
    assert int(again) == int(other_key) == int(plain) == int(first) == in_bulk[0]
    assert sem.live_count() == 2


def test_the_async_enqueues_honour_queued_keys_of_keyed_jobs(sem: Sem) -> None:
    @sem.app.task(name="report")
    def report(n: int) -> None: ...

    keyed = report.with_options(ordering_key="a", unique_key="u", unique_scope="queued")

    async def enqueue() -> tuple[skiplock.JobRef, skiplock.JobRef, list[int]]:
        async with await psycopg.AsyncConnection.connect(sem.url) as conn:
            first = await keyed.enqueue_async(conn, n=1)
            second = await keyed.enqueue_async(conn, n=2)
            many = await sem.app.enqueue_many_async(conn, [keyed.job(n=3)])
            await conn.commit()
        return first, second, many

    first, second, many = asyncio.run(enqueue())
    assert second.duplicate and int(second) == int(first) == many[0]
    assert sem.live_count() == 1


def test_a_queued_key_shared_by_two_ordering_keys_never_stops_admission(
    sem: Sem, workers: StartWorkers
) -> None:
    """Two waiting jobs of different ordering keys under one queued unique key: the second
    used to be accepted, and admitting both then failed on jobs_unique_queued for every
    key, forever."""
    ran: list[int] = []

    @sem.app.task(name="report")
    def report(n: int) -> None:
        ran.append(n)

    def queued(key: str) -> TaskCall[None]:
        return report.with_options(ordering_key=key, unique_key="u", unique_scope="queued")

    a = sem.enqueue(queued("a"), n=1)
    b = sem.enqueue(queued("b"), n=2)
    c = sem.enqueue(report.with_options(ordering_key="c"), n=3)
    workers(1)

    sem.wait_for_all([int(a), int(c)], "completed", timeout=PATIENCE)
    assert b.duplicate and int(b) == int(a)
    assert sorted(ran) == [1, 3]


# -- 9: pruning windows ----------------------------------------------------------------


def test_pruning_never_deletes_a_window_an_enqueue_has_just_re_taken(sem: Sem) -> None:
    @sem.app.task(name="tick", unique=True, unique_window=3600)
    def tick(n: int) -> None: ...

    old = int(sem.enqueue(tick, n=1))
    finish(sem, old)
    sem.execute("UPDATE {unique_windows} SET expires_at = now() - interval '1 second'")

    with sem.connect(autocommit=False) as enqueuer, sem.connect() as maintainer:
        # The enqueue re-takes the expired window (its row is now locked by this
        # transaction), and maintenance, which read the window as expired, must wait.
        again = tick.enqueue(enqueuer, n=1)
        assert not again.duplicate
        with ThreadPoolExecutor(1) as pool:
            pruning = pool.submit(history.maintain, maintainer, sem.schema, retention=None)
            pid = maintainer.info.backend_pid
            wait_until(lambda: sem.waiting_on_lock(pid) or pruning.done(), 10, "the prune")
            assert not pruning.done(), "the prune did not wait for the enqueue"
            enqueuer.commit()
            report = pruning.result(timeout=10)

    assert report.expired_windows == 0
    assert sem.execute("SELECT job_id FROM {unique_windows}") == [(int(again),)]
    finish(sem, int(again))
    within_the_window = sem.enqueue(tick, n=1)
    assert within_the_window.duplicate and int(within_the_window) == int(again)


# -- 10: a holder leaving during a bulk enqueue ----------------------------------------


def announce_inserts(sem: Sem) -> None:
    """A statement trigger on the jobs table that raises a NOTICE after every INSERT: the
    client receives it while it is still reading that INSERT's result, i.e. after the
    conflict checks and before its next statement."""
    function = sql.Identifier(sem.schema, "announce_inserts")
    with sem.connect() as conn:
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {} () RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE NOTICE 'jobs inserted'; RETURN NULL; END $$"
            ).format(function)
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER announce_inserts AFTER INSERT ON {} "
                "FOR EACH STATEMENT EXECUTE FUNCTION {} ()"
            ).format(sql.Identifier(sem.schema, "jobs"), function)
        )


class HolderLeaves:
    """At the first NOTICE: another session completes the holder (deletes its row, as a
    completion does) and commits."""

    def __init__(self, sem: Sem, holder: int) -> None:
        self.sem = sem
        self.holder = holder
        self.done = threading.Event()

    def __call__(self, diagnostic: psycopg.errors.Diagnostic) -> None:
        if self.done.is_set() or diagnostic.message_primary != "jobs inserted":
            return
        self.done.set()
        with self.sem.connect() as other:
            assert client.delete_jobs(other, self.sem.schema, [self.holder]) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_enqueue_many_inserts_again_when_the_holder_leaves_before_the_look_up(
    sem: Sem, mode: str
) -> None:
    @sem.app.task(name="invoice")
    def invoice(n: int) -> None: ...

    unique = invoice.with_options(unique_key="u")
    queued = invoice.with_options(unique_key="q", unique_scope="queued")
    holder = int(sem.enqueue(unique, n=0))
    queued_holder = int(sem.enqueue(queued, n=0))
    announce_inserts(sem)
    specs = [invoice.job(n=1), unique.job(n=2), queued.job(n=3), unique.job(n=4)]
    leaves = HolderLeaves(sem, holder)

    if mode == "sync":
        with sem.connect(autocommit=False) as conn:
            conn.add_notice_handler(leaves)
            ids = sem.app.enqueue_many(conn, specs)
            conn.commit()
    else:

        async def enqueue() -> list[int]:
            async with await psycopg.AsyncConnection.connect(sem.url) as conn:
                conn.add_notice_handler(leaves)
                ids = await sem.app.enqueue_many_async(conn, specs)
                await conn.commit()
            return ids

        ids = asyncio.run(enqueue())

    assert leaves.done.is_set()
    plain, taken, still_held, same = ids
    assert taken not in (holder, plain) and same == taken
    assert still_held == queued_holder
    live = dict(sem.execute("SELECT id, unique_key FROM {jobs} WHERE unique_key IS NOT NULL"))
    assert live == {taken: "u"}
    assert sorted(row[0] for row in sem.execute("SELECT id FROM {jobs}")) == sorted(
        {plain, taken, queued_holder}
    )
