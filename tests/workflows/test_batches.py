"""Batches (migration 0024, decision 025): jobs added in several transactions, a callback
that runs once after the close and every job's end, with the counts of how they ended."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest

import skiplock
from roles import login_roles
from skiplock import grants
from skiplock.grants import Use
from workflows.conftest import Calls, RunCli, Sem, StartWorkers
from workflows.helpers import wait_for_workflow

pytestmark = pytest.mark.server_version


def tasks(sem: Sem, calls: Calls) -> tuple[skiplock.Task[Any], skiplock.Task[Any]]:
    """A job that fails when told (one attempt), and a callback recording its counts."""

    @sem.app.task(name="work", max_attempts=1)
    def work(n: int, fail: bool = False) -> int:
        calls.record(("work", n))
        if fail:
            raise ValueError(f"job {n} fails")
        return n

    @sem.app.task(name="summary")
    def summary(label: str) -> None:
        calls.record(("summary", label))
        calls.mark("counts", skiplock.batch_counts())

    return work, summary


def add(sem: Sem, batch: skiplock.Batch, jobs: list[skiplock.JobSpec]) -> list[skiplock.JobRef]:
    with sem.connect(autocommit=False) as conn:
        refs = batch.add(conn, jobs)
        conn.commit()
    return refs


def close(sem: Sem, batch: skiplock.Batch) -> bool:
    with sem.connect(autocommit=False) as conn:
        closed = batch.close(conn)
        conn.commit()
    return closed


def callback_state(sem: Sem, batch: skiplock.Batch) -> str:
    return str(
        sem.execute(
            "SELECT coalesce(j.state, h.state) FROM {schema}.workflow_steps AS s "
            "LEFT JOIN {jobs} AS j ON j.id = s.job_id LEFT JOIN {history} AS h ON h.id = s.job_id "
            "WHERE s.workflow_id = %s AND s.step = 1",
            (batch.id,),
        )[0][0]
    )


def test_the_callback_waits_for_the_close_then_runs_once_with_the_counts(
    sem: Sem, workers: StartWorkers, run_cli: RunCli
) -> None:
    calls = Calls()
    work, summary = tasks(sem, calls)
    batch = sem.app.batch(summary.job(label="nightly"), name="nightly")
    assert batch.id is None  # nothing written yet
    first = add(sem, batch, [work.job(n=1), work.job(n=2, fail=True)])
    second = add(sem, batch, [work.job(n=3), work.job(n=4)])
    workers(1)
    sem.wait_for_all([*first, *second], "completed", "dead")
    # Every job has ended, but the batch is open: more may come.
    assert callback_state(sem, batch) == "waiting"
    assert calls.counts[("summary", "nightly")] == 0
    shown = run_cli("workflows", "show", str(batch.id)).out.splitlines()
    assert shown[0] == (
        f"batch {batch.id} 'nightly' (open: its callback also waits for the close): "
        "running, 4/5 steps ended, 1 failed"
    )
    assert close(sem, batch) is True
    assert batch.id is not None
    wait_for_workflow(sem, batch.id, "failed")  # a job ended dead
    assert calls.counts[("summary", "nightly")] == 1
    assert calls.marked("counts") == {skiplock.BatchCounts(completed=3, dead=1, cancelled=0)}
    assert close(sem, batch) is False  # closed already: nothing happens


def test_closed_before_its_jobs_end_the_callback_runs_after_the_last(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()
    release = threading.Event()
    _, summary = tasks(sem, calls)

    @sem.app.task(name="slow")
    def slow(n: int) -> None:
        assert release.wait(30)
        calls.mark("slow done", n)

    batch = sem.app.batch(summary.job(label="slow"))
    refs = add(sem, batch, [slow.job(n=n) for n in range(3)])
    assert close(sem, batch) is True
    workers(1)
    for ref in refs:
        sem.wait_for_state(ref, "running")
    assert callback_state(sem, batch) == "waiting"
    release.set()
    assert batch.id is not None
    wait_for_workflow(sem, batch.id, "completed")
    assert calls.marked("slow done") == {0, 1, 2}
    assert calls.marked("counts") == {skiplock.BatchCounts(3, 0, 0)}


def test_an_empty_batch_closed_runs_its_callback_at_once(sem: Sem, workers: StartWorkers) -> None:
    calls = Calls()
    _, summary = tasks(sem, calls)
    batch = sem.app.batch(summary.job(label="empty"))
    assert close(sem, batch) is True
    workers(1)
    assert batch.id is not None
    wait_for_workflow(sem, batch.id, "completed")
    assert calls.marked("counts") == {skiplock.BatchCounts(0, 0, 0)}


def test_rollbacks_take_their_jobs_and_a_closed_batch_takes_no_more(sem: Sem) -> None:
    calls = Calls()
    work, summary = tasks(sem, calls)
    batch = sem.app.batch(summary.job(label="x"))
    add(sem, batch, [work.job(n=1)])
    with sem.connect(autocommit=False) as conn:
        batch.add(conn, [work.job(n=2), work.job(n=3)])
        conn.rollback()
    assert batch.id is not None
    counts = sem.execute(
        "SELECT w.steps, w.steps_left, s.pending FROM {schema}.workflows AS w "
        "JOIN {schema}.workflow_steps AS s ON s.workflow_id = w.id AND s.step = 1 "
        "WHERE w.id = %s",
        (batch.id,),
    )
    assert tuple(counts[0]) == (2, 2, 2)  # the callback and job 1; the close to come
    close(sem, batch)
    with sem.connect() as conn:
        with pytest.raises(skiplock.EnqueueError, match=f"batch {batch.id} is closed"):
            batch.add(conn, [work.job(n=4)])
        with pytest.raises(skiplock.EnqueueError, match="does not exist"):
            sem.app.batch_by_id(batch.id + 1000).add(conn, [work.job(n=5)])
        with pytest.raises(skiplock.EnqueueError, match="does not exist"):
            sem.app.batch_by_id(batch.id + 1000).close(conn)
    # A batch whose creating transaction rolled back is said so at its next use.
    lost = sem.app.batch(summary.job(label="lost"))
    with sem.connect(autocommit=False) as conn:
        lost.add(conn, [work.job(n=6)])
        conn.rollback()
    with sem.connect() as conn, pytest.raises(skiplock.EnqueueError, match="rolled back"):
        lost.add(conn, [work.job(n=7)])


def test_bad_input_is_refused_before_anything_is_written(sem: Sem) -> None:
    calls = Calls()
    work, summary = tasks(sem, calls)

    @sem.app.task(name="once", unique=True)
    def once() -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="needs its callback"):
        sem.app.batch(None)  # type: ignore[arg-type]
    with pytest.raises(skiplock.ConfigurationError, match="unique jobs cannot join"):
        sem.app.batch(once.job())
    batch = sem.app.batch(summary.job(label="x"))
    with sem.connect() as conn:
        with pytest.raises(skiplock.ConfigurationError, match="job 1 is a job from"):
            batch.add(conn, [work.job(n=1), "work"])  # type: ignore[list-item]
        with pytest.raises(skiplock.ConfigurationError, match="unique jobs cannot join"):
            batch.add(conn, [once.job()])
    with pytest.raises(skiplock.ConfigurationError, match="positive integer"):
        sem.app.batch_by_id(0)
    assert batch.id is None
    assert sem.execute("SELECT count(*) FROM {schema}.workflows")[0][0] == 0


@pytest.mark.timeout(120)
def test_jobs_added_from_four_threads_while_workers_drain_end_in_one_callback(
    sem: Sem, workers: StartWorkers
) -> None:
    """Adds and completions meet on the callback's row; neither deadlocks, none is lost,
    and the callback runs once, after the last job of all, with every job counted."""
    calls = Calls()
    work, summary = tasks(sem, calls)
    batch = sem.app.batch(summary.job(label="busy"))
    add(sem, batch, [work.job(n=0)])
    workers(2)
    errors: list[BaseException] = []

    def feed(thread: int) -> None:
        try:
            for round_ in range(10):
                base = 1 + thread * 1000 + round_ * 10
                add(sem, batch, [work.job(n=base + i) for i in range(10)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert callback_state(sem, batch) == "waiting"
    close(sem, batch)
    assert batch.id is not None
    wait_for_workflow(sem, batch.id, "completed", timeout=60)
    ran = [key for key in calls.counts if key[0] == "work"]
    assert len(ran) == 401 and all(calls.counts[key] == 1 for key in ran)
    assert calls.counts[("summary", "busy")] == 1
    assert calls.marked("counts") == {skiplock.BatchCounts(401, 0, 0)}


def test_a_cancelled_job_is_counted_as_cancelled(sem: Sem, workers: StartWorkers) -> None:
    calls = Calls()
    work, summary = tasks(sem, calls)

    @sem.app.task(name="later")
    def later() -> None: ...

    batch = sem.app.batch(summary.job(label="c"))
    refs = add(sem, batch, [work.job(n=1), later.with_options(delay=3600).job()])
    with sem.connect() as conn:
        skiplock.Admin(sem.app, conn).cancel_job(refs[1])
    close(sem, batch)
    workers(1)
    assert batch.id is not None
    wait_for_workflow(sem, batch.id, "failed")
    assert calls.marked("counts") == {skiplock.BatchCounts(1, 0, 1)}


def test_async_add_and_close(sem: Sem, workers: StartWorkers) -> None:
    calls = Calls()
    work, summary = tasks(sem, calls)
    batch = sem.app.batch(summary.job(label="async"))

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(sem.app.database_url) as conn:
            refs = await batch.add_async(conn, work.job(n=1))
            assert len(refs) == 1
            assert await batch.close_async(conn) is True
            await conn.commit()

    asyncio.run(main())
    workers(1)
    assert batch.id is not None
    wait_for_workflow(sem, batch.id, "completed")
    assert calls.marked("counts") == {skiplock.BatchCounts(1, 0, 0)}


def test_a_role_granted_to_enqueue_may_add_and_close(
    sem: Sem, database_url: str, workers: StartWorkers
) -> None:
    calls = Calls()
    work, summary = tasks(sem, calls)
    with login_roles(database_url) as roles:
        role, url = roles.create("enqueue")
        with psycopg.connect(database_url) as owner:
            grants.apply(owner, sem.schema, role, Use.ENQUEUE)
        batch = sem.app.batch(summary.job(label="role"))
        with psycopg.connect(url) as conn:
            batch.add(conn, [work.job(n=1)])
            assert batch.close(conn) is True
    workers(1)
    assert batch.id is not None
    wait_for_workflow(sem, batch.id, "completed")
    assert calls.marked("counts") == {skiplock.BatchCounts(1, 0, 0)}
