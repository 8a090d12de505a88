"""A keyed job's successor is admitted by the statement that ends it (migration 0015,
decision 017): a completion, a cancellation or a DELETE by hand admits its keys' next
jobs in its own transaction, with the rules and the locks of the leader's admission, and
hands the keys to the leader instead whenever it cannot (a key held elsewhere, a row the
database refuses, more keys than one statement should lock). The statement itself never
fails for it.

Interleavings are made deterministic by holding a transaction open on a key's lock.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql

from conftest import wait_until
from skiplock import admission
from skiplock.admission import AdmissionReport
from skiplock.config import control_channel, notify_channel
from skiplock.sql import keys, render

from .conftest import Sem, StartWorkers
from .timeline import Timeline

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

PATIENCE = 30.0


class Notes:
    """Every payload on one channel, from a LISTEN connection of its own. ``collect``
    returns those that arrived before a sentinel it sends: notifications reach a session
    in commit order, so nothing earlier is missed and nothing is waited for."""

    def __init__(self, url: str, channel: str) -> None:
        self.url = url
        self.channel = channel
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def collect(self) -> list[str]:
        sentinel = f"sentinel-{uuid.uuid4().hex}"
        with psycopg.connect(self.url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (self.channel, sentinel))
        payloads: list[str] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for note in self.conn.notifies(timeout=deadline - time.monotonic(), stop_after=1):
                if note.payload == sentinel:
                    return payloads
                payloads.append(note.payload)
        raise AssertionError("the sentinel notification did not arrive")


@pytest.fixture
def control(sem: Sem) -> Iterator[Notes]:
    notes = Notes(sem.url, control_channel(sem.schema))
    yield notes
    notes.conn.close()


@pytest.fixture
def wakeups(sem: Sem) -> Iterator[Notes]:
    notes = Notes(sem.url, notify_channel(sem.schema))
    yield notes
    notes.conn.close()


def admit(sem: Sem, asked: Sequence[str] | None = None) -> int:
    """The leader's admission of the keys asked about (every waiting key by default)."""
    with sem.connect() as conn:
        if asked is None:
            asked = [row[0] for row in conn.execute(render(keys.KEYS_WAITING, sem.schema))]
        rows = conn.execute(render(keys.ADMIT, sem.schema), {"keys": list(asked)}).fetchall()
    return sum(int(row[1]) for row in rows)


def finish(sem: Sem, *ids: int) -> None:
    """The jobs end as a completion ends them: their rows go, in one statement."""
    rows = sem.execute("DELETE FROM {jobs} WHERE id = ANY(%s) RETURNING id", (list(ids),))
    assert sorted(row[0] for row in rows) == sorted(ids)


def states(sem: Sem, ids: Sequence[int]) -> list[str | None]:
    found = dict(sem.execute("SELECT id, state FROM {jobs} WHERE id = ANY(%s)", (list(ids),)))
    return [found.get(job_id) for job_id in ids]


def hold_keys(sem: Sem, *held: str) -> psycopg.Connection[Any]:
    """A transaction that holds the keys' locks (as an admitter does) until it ends."""
    conn = sem.connect(autocommit=False)
    conn.execute(render(keys.KEYS_LOCK, sem.schema), {"keys": list(held)})
    return conn


def test_ending_an_admitted_job_admits_the_next_one_of_its_key_at_once(
    sem: Sem, wakeups: Notes, control: Notes
) -> None:
    @sem.app.task(name="ship")
    def ship(n: int) -> None: ...

    line = [int(sem.enqueue(ship.with_options(ordering_key="order:1"), n=n)) for n in range(3)]
    other = int(sem.enqueue(ship.with_options(ordering_key="order:2"), n=9))
    assert admit(sem) == 2
    wakeups.collect()
    control.collect()

    finish(sem, line[0])

    # No leader ran: the DELETE itself admitted the next job, and woke the queue.
    assert states(sem, [*line, other]) == [None, "available", "blocked", "available"]
    assert [payload.split("\t")[0] for payload in wakeups.collect()] == ["default"]
    assert control.collect() == []  # nothing asked of the leader
    finish(sem, line[1])
    assert states(sem, line) == [None, None, "available"]


def test_one_statement_ending_jobs_of_many_keys_admits_each_within_its_own_limits(
    sem: Sem,
) -> None:
    """The rules of the leader's admission (decision 011), keys of mixed limits included:
    a key never has more admitted jobs than the lowest limit among them."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    wide = sync.with_options(concurrency_key="k", concurrency_limit=3)
    narrow = sync.with_options(concurrency_key="k", concurrency_limit=1)
    first = [int(sem.enqueue(wide, n=n)) for n in range(3)]
    behind = [int(sem.enqueue(narrow, n=3)), int(sem.enqueue(wide, n=4))]
    ordered = [int(sem.enqueue(sync.with_options(ordering_key="o"), n=n)) for n in range(2)]
    assert admit(sem) == 3 + 1
    assert states(sem, behind) == ["blocked", "blocked"]

    finish(sem, first[0], ordered[0])
    # The job of limit 1 must run alone: two of limit 3 are still admitted.
    assert states(sem, [*behind, ordered[1]]) == ["blocked", "blocked", "available"]
    finish(sem, first[1], first[2])
    assert states(sem, behind) == ["available", "blocked"]
    finish(sem, behind[0])
    assert states(sem, behind) == [None, "available"]


def test_an_ending_that_cannot_have_a_key_at_once_hands_it_to_the_leader(
    sem: Sem, control: Notes
) -> None:
    """A key held elsewhere for long (a transactional session runs a job of it) is waited
    for only briefly: the DELETE goes through, and the leader is asked for the key."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    call = sync.with_options(concurrency_key="k", concurrency_limit=2)
    line = [int(sem.enqueue(call, n=n)) for n in range(4)]
    assert admit(sem) == 2
    control.collect()
    holder = hold_keys(sem, "k")
    try:
        started = time.monotonic()
        finish(sem, line[0])
        assert time.monotonic() - started < 5
        assert states(sem, line) == [None, "available", "blocked", "blocked"]
        assert control.collect() == ["admit\tk"]
    finally:
        holder.rollback()
        holder.close()
    assert admit(sem, ["k"]) == 1
    assert states(sem, line) == [None, "available", "available", "blocked"]


def test_two_endings_of_one_key_at_once_never_admit_past_its_limit(sem: Sem) -> None:
    """Both transactions delete a job of the key; the second waits for the first's lock,
    and its snapshot, taken once it has it, sees what the first admitted."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    call = sync.with_options(concurrency_key="k", concurrency_limit=2)
    line = [int(sem.enqueue(call, n=n)) for n in range(6)]
    assert admit(sem) == 2
    first = sem.connect(autocommit=False)
    try:
        first.execute(render("DELETE FROM {jobs} WHERE id = %s", sem.schema), (line[0],))
        with sem.connect() as second:
            pid = second.info.backend_pid
            ended = threading.Thread(
                target=second.execute,
                args=(render("DELETE FROM {jobs} WHERE id = %s", sem.schema), (line[1],)),
            )
            ended.start()
            wait_until(lambda: sem.waiting_on_lock(pid), 10, "the second ending to wait")
            first.commit()
            ended.join(10)
            assert not ended.is_alive()
    finally:
        first.close()
    assert states(sem, line) == [None, None, "available", "available", "blocked", "blocked"]


def test_a_row_the_database_refuses_never_fails_the_ending_and_goes_to_the_leader(
    sem: Sem, control: Notes
) -> None:
    @sem.app.task(name="sync")
    def sync(n: int, poison: bool = False) -> None: ...

    sem.execute(
        "ALTER TABLE {jobs} ADD CONSTRAINT no_poison_runs "
        "CHECK (state IN ('blocked', 'dead') OR NOT args ? 'poison')"
    )
    call = sync.with_options(ordering_key="bad")
    line = [int(sem.enqueue(call, n=0)), int(sem.enqueue(call, n=1, poison=True))]
    line.append(int(sem.enqueue(call, n=2)))
    assert admit(sem) == 1
    control.collect()

    finish(sem, line[0])  # the completion is written; its key is the leader's now

    assert states(sem, line) == [None, "blocked", "blocked"]
    assert control.collect() == ["admit\tbad"]
    report = admit_pass(sem, ["bad"])
    assert report.dead == [line[1]]
    assert states(sem, line) == [None, "dead", "available"]


def test_an_ending_in_a_repeatable_read_transaction_hands_its_keys_to_the_leader(
    sem: Sem, control: Notes
) -> None:
    """Its snapshot is older than the keys' locks: admitting there could pass a limit."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    line = [int(sem.enqueue(sync.with_options(ordering_key="rr"), n=n)) for n in range(2)]
    assert admit(sem) == 1
    control.collect()
    with sem.connect(autocommit=False) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute(render("DELETE FROM {jobs} WHERE id = %s", sem.schema), (line[0],))
        conn.commit()

    assert states(sem, line) == [None, "blocked"]
    assert control.collect() == ["admit\trr"]
    assert admit(sem, ["rr"]) == 1


def admit_pass(sem: Sem, asked: Sequence[str] | None, *, stalled: bool = False) -> AdmissionReport:
    async def run() -> AdmissionReport:
        async with await psycopg.AsyncConnection.connect(sem.url, autocommit=True) as conn:
            return await admission.admit_pass(conn, sem.schema, asked, stalled=stalled)

    return asyncio.run(run())


def test_the_leader_leaves_a_key_held_elsewhere_and_names_it(sem: Sem) -> None:
    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    held = int(sem.enqueue(sync.with_options(ordering_key="held"), n=0))
    free = int(sem.enqueue(sync.with_options(ordering_key="free"), n=1))
    holder = hold_keys(sem, "held")
    try:
        started = time.monotonic()
        report = admit_pass(sem, None)
        assert time.monotonic() - started < 5  # not waited for
    finally:
        holder.rollback()
        holder.close()

    assert (report.admitted, report.busy) == (1, ["held"])
    assert states(sem, [held, free]) == ["blocked", "available"]
    assert admit_pass(sem, report.busy).admitted == 1


def test_the_leader_comes_back_for_a_key_it_found_held(
    sem: Sem, workers: StartWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A moment later, not at its next periodic pass (a minute away here)."""
    from skiplock.worker.leader import KeyAdmission as Admission  # noqa: PLC0415 - spied on

    found_held = threading.Event()
    original = Admission.admit_pass

    async def spied(self: Admission, asked: list[str] | None) -> tuple[int, dict[str, float]]:
        admitted, due = await original(self, asked)
        if "held" in due:
            found_held.set()
        return admitted, due

    monkeypatch.setattr(Admission, "admit_pass", spied)
    ran = threading.Event()

    @sem.app.task(name="sync")
    def sync(n: int) -> None:
        ran.set()

    workers(1, admit_interval=60.0)
    holder = hold_keys(sem, "held")
    try:
        job = int(sem.enqueue(sync.with_options(ordering_key="held"), n=0))
        assert found_held.wait(PATIENCE), "the leader's pass did not meet the held key"
        assert states(sem, [job]) == ["blocked"]
    finally:
        holder.rollback()
        holder.close()
    assert ran.wait(PATIENCE)


def test_the_periodic_pass_visits_the_keys_a_lost_request_leaves_waiting(sem: Sem) -> None:
    """Keys with waiting jobs and none admitted wait for good if their request was lost;
    keys with admitted jobs are admitted again when those end, and are left alone."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    running = [int(sem.enqueue(sync.with_options(ordering_key="running"), n=n)) for n in (0, 1)]
    assert admit(sem, ["running"]) == 1
    wide = sync.with_options(concurrency_key="wide", concurrency_limit=3)
    partly = [int(sem.enqueue(wide, n=n)) for n in (2, 3)]
    assert admit(sem, ["wide"]) == 2
    partly.append(int(sem.enqueue(wide, n=4)))  # its request lost: the key has room
    lost = [int(sem.enqueue(sync.with_options(ordering_key="lost"), n=n)) for n in (5, 6)]
    asked = int(sem.enqueue(sync.with_options(ordering_key="asked"), n=7))

    report = admit_pass(sem, ["asked"], stalled=True)

    assert report.admitted == 2
    assert states(sem, [*running, *partly, *lost, asked]) == [
        "available",
        "blocked",
        "available",
        "available",
        "blocked",  # admitted when one of the others ends
        "available",
        "blocked",
        "available",
    ]


def test_a_full_pass_admits_more_keys_than_one_transaction_locks(sem: Sem) -> None:
    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    count = admission.ADMIT_KEYS_CHUNK * 2 + 7
    ids = sem.enqueue_many([sync.with_options(ordering_key=f"k{n}").job(n=n) for n in range(count)])

    assert admit_pass(sem, None).admitted == count
    assert set(states(sem, ids)) == {"available"}


def test_an_ending_of_more_keys_than_it_locks_hands_the_rest_to_the_leader(
    sem: Sem, control: Notes
) -> None:
    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    count = 640  # beyond the 512 keys one DELETE admits itself
    specs = [sync.with_options(ordering_key=f"k{n:04}").job(n=n) for n in range(count)]
    heads = sem.enqueue_many(specs)
    nexts = sem.enqueue_many(specs)
    assert admit_pass(sem, None).admitted == count
    control.collect()

    finish(sem, *heads)

    admitted = states(sem, nexts)
    assert admitted.count("available") == 512
    assert control.collect() == ["admit"]  # a full pass for the rest
    assert admit_pass(sem, None).admitted == count - 512


def test_workers_run_chains_in_order_one_at_a_time_while_completions_admit(
    sem: Sem, workers: StartWorkers
) -> None:
    timeline = Timeline()

    @sem.app.task(name="step")
    def step(key: str, n: int) -> None:
        with timeline.run(key, n):
            threading.Event().wait(0.002)

    chains = {f"chain:{c}": 12 for c in range(6)}
    ids = sem.enqueue_many(
        [step.with_options(ordering_key=key).job(key=key, n=n) for n in range(12) for key in chains]
    )
    workers(3, concurrency=4)

    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    for key, length in chains.items():
        runs = timeline.runs(key)
        assert [run.n for run in runs] == list(range(length))
        for before, after in itertools.pairwise(runs):
            assert not before.overlaps(after)
