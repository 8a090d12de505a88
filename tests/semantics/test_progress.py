"""Progress: ``skiplock.set_progress(value)`` in a lease-mode handler records a small JSON
value on the running job (written by the worker's maintenance loop, the latest value
winning), readable with ``get_job`` and kept in history when the job finishes."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import skiplock
from conftest import wait_until

from .conftest import Calls, Sem, StartWorkers

pytestmark = pytest.mark.timeout(60)


def test_progress_is_visible_while_running_and_kept_in_history(
    sem: Sem, workers: StartWorkers
) -> None:
    release = threading.Event()

    def steps(n: int) -> None:
        for done in range(1, 6):
            skiplock.set_progress({"n": n, "done": done, "of": 5})

    @sem.app.task(name="sync_import")
    def sync_import(n: int) -> int:
        steps(n)
        release.wait(20)
        return n

    @sem.app.task(name="async_import")
    async def async_import(n: int) -> int:
        steps(n)
        while not release.is_set():
            await asyncio.sleep(0.01)
        return n

    workers(3)
    ids = {n: sem.enqueue(sync_import if n % 2 else async_import, n=n) for n in range(8)}

    def all_visible() -> bool:
        return all(
            sem.job(job_id).progress == {"n": n, "done": 5, "of": 5} for n, job_id in ids.items()
        )

    try:
        sem.wait_for_all(list(ids.values()), "running")
        wait_until(all_visible, 15, "every job's latest progress")
        assert all(sem.job(job_id).state is skiplock.JobState.RUNNING for job_id in ids.values())
    finally:
        release.set()
    sem.wait_for_all(list(ids.values()), "completed")
    for n, job_id in ids.items():
        job = sem.job(job_id)
        assert (job.result, job.progress) == (n, {"n": n, "done": 5, "of": 5})


def test_the_last_progress_before_the_job_finishes_is_kept(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="quick")
    def quick() -> str:
        skiplock.set_progress({"done": 100, "of": 100})
        return "done"

    # The maintenance loop then writes progress every ten seconds (lease / 3).
    workers(1, rescue_interval=30.0)
    job_id = sem.enqueue(quick)

    job = sem.wait_for_state(job_id, "completed")
    assert job.progress == {"done": 100, "of": 100}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_progress_that_is_not_json_raises_value_error_in_the_handler(
    sem: Sem, workers: StartWorkers, kind: str
) -> None:
    calls = Calls()

    def report() -> None:
        for bad in (float("nan"), "x" * (64 * 1024)):
            try:
                skiplock.set_progress(bad)
            except ValueError as exc:
                calls.mark("refused", str(exc).split(":")[0])
        skiplock.set_progress({"at": object()})  # not caught: the job fails with it

    def sync_report() -> None:
        report()

    async def async_report() -> None:
        report()

    handler: Any = sync_report if kind == "sync" else async_report
    task = sem.app.task(name="report", max_attempts=1)(handler)
    workers(2)
    job_id = sem.enqueue(task)

    job = sem.wait_for_state(job_id, "dead")
    assert [error["type"] for error in job.errors] == ["ValueError"]
    assert job.errors[0]["message"].startswith("progress must be JSON")
    assert calls.marked("refused") == {
        "progress must be JSON",
        f"progress is {64 * 1024 + 2} bytes of JSON; keep it under 64 KiB",
    }
    assert job.progress is None


def test_set_progress_and_current_job_outside_a_job_raise_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="outside a running"):
        skiplock.set_progress({"done": 1})
    with pytest.raises(RuntimeError, match="outside a running job"):
        skiplock.current_job()
