"""Steps added by a running step (migration 0025): they run after it, what ran after it
waits for them, names make adding idempotent, and only the live attempt adds."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import skiplock
from skiplock.context import set_current_job
from workflows.conftest import Calls, Sem, StartWorkers
from workflows.helpers import enqueue, step_states, wait_for_workflow

pytestmark = pytest.mark.server_version


def test_a_crawler_adds_pages_that_run_after_it_and_before_its_report(
    sem: Sem, workers: StartWorkers
) -> None:
    calls = Calls()
    seen: dict[str, Any] = {}

    @sem.app.task(name="page")
    def page(url: str) -> str:
        calls.record(url)
        seen[url] = skiplock.parent_results()
        return url.upper()

    @sem.app.task(name="crawl", max_attempts=2)
    def crawl() -> str:
        pages = {f"page {u}": page.job(url=u) for u in ("a", "b", "c")}
        first = skiplock.add_steps(pages)
        # Added again (a loop, or this attempt run again): the same steps, none new.
        again = skiplock.add_steps({"page b": page.job(url="b"), "page d": page.job(url="d")})
        assert again["page b"] == first["page b"]
        if calls.record("crawl") == 1:
            raise RuntimeError("the first attempt fails after adding its pages")
        return "crawled"

    @sem.app.task(name="report")
    def report() -> None:
        seen["report"] = skiplock.parent_results()

    wf = sem.app.workflow("crawler")
    crawled = wf.add(crawl.job(), name="crawl")
    wf.add(report.job(), name="report", after=[crawled])
    ref = enqueue(sem, wf)
    workers(1)
    wait_for_workflow(sem, ref.id, "completed")

    assert calls.counts["crawl"] == 2
    assert {u: calls.counts[u] for u in "abcd"} == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert seen["a"] == {"crawl": "crawled"}
    assert seen["report"] == {
        "crawl": "crawled",
        "page a": "A",
        "page b": "B",
        "page c": "C",
        "page d": "D",
    }
    assert sorted(step_states(sem, ref.id)) == [
        "crawl",
        "page a",
        "page b",
        "page c",
        "page d",
        "report",
    ]
    counts = sem.execute(
        "SELECT steps, steps_left FROM {schema}.workflows WHERE id = %s", (ref.id,)
    )
    assert tuple(counts[0]) == (6, 0)


def test_an_attempt_that_is_no_longer_the_live_one_adds_nothing(
    sem: Sem, workers: StartWorkers
) -> None:
    """The attempt number is the fence: an earlier attempt's worker (its lease lost, the
    job claimed again) is refused, as its outcome would be."""
    refused: list[str] = []

    @sem.app.task(name="extra")
    def extra() -> None: ...

    @sem.app.task(name="adder")
    def adder() -> None:
        live = skiplock.current_job()
        stale = dataclasses.replace(live, attempts=live.attempts - 1)
        set_current_job(stale)
        try:
            skiplock.add_steps({"extra": extra.job()})
        except skiplock.EnqueueError as exc:
            refused.append(str(exc))
        finally:
            set_current_job(live)

    ref = enqueue(sem, skiplock.chain(adder.job(), app=sem.app))
    workers(1)
    wait_for_workflow(sem, ref.id, "completed")
    assert len(refused) == 1 and "no longer running as attempt 0" in refused[0]
    assert list(step_states(sem, ref.id)) == ["adder"]


def test_add_steps_is_refused_outside_a_lease_mode_step_and_for_bad_input(
    sem: Sem, workers: StartWorkers
) -> None:
    errors: dict[str, str] = {}

    @sem.app.task(name="x")
    def x() -> None: ...

    @sem.app.task(name="in_transaction", transactional=True)
    def in_transaction(conn: Any) -> None:
        try:
            skiplock.add_steps({"x": x.job()})
        except skiplock.ConfigurationError as exc:
            errors["transactional"] = str(exc)

    @sem.app.task(name="bad")
    def bad() -> None:
        for label, given in (
            ("list", [x.job()]),
            ("not a job", {"y": "x"}),
            ("empty name", {"": x.job()}),
        ):
            try:
                skiplock.add_steps(given)  # type: ignore[arg-type]
            except skiplock.ConfigurationError as exc:
                errors[label] = str(exc)

    with pytest.raises(RuntimeError, match="outside a running job"):
        skiplock.add_steps({"x": x.job()})
    ref = enqueue(sem, skiplock.group(in_transaction.job(), bad.job(), app=sem.app))
    workers(1)
    wait_for_workflow(sem, ref.id, "completed")
    assert "for lease-mode steps" in errors["transactional"]
    assert "a mapping of step name to job" in errors["list"]
    assert "is a job from task.job" in errors["not a job"]
    assert "step name must be a non-empty string" in errors["empty name"]
    assert sorted(step_states(sem, ref.id)) == ["bad", "in_transaction"]


def test_async_steps_add_too(sem: Sem, workers: StartWorkers) -> None:
    calls = Calls()

    @sem.app.task(name="leaf")
    def leaf(n: int) -> None:
        calls.record(n)

    @sem.app.task(name="root")
    async def root() -> None:
        await skiplock.add_steps_async({f"leaf {n}": leaf.job(n=n) for n in range(3)})

    ref = enqueue(sem, skiplock.chain(root.job(), app=sem.app))
    workers(1)
    wait_for_workflow(sem, ref.id, "completed")
    assert dict(calls.counts) == {0: 1, 1: 1, 2: 1}


@pytest.mark.timeout(120)
def test_two_steps_adding_at_once_to_one_fan_in_release_it_once_after_all(
    sem: Sem, workers: StartWorkers
) -> None:
    """Two steps add pages in rounds at the same time, each round also counted into the
    fan-in after both (they meet on its row); it runs once, after every page."""
    calls = Calls()

    @sem.app.task(name="leaf")
    def leaf(n: int) -> int:
        calls.record(("leaf", n))
        return n

    @sem.app.task(name="adder")
    def adder(base: int) -> None:
        for round_ in range(5):
            skiplock.add_steps(
                {
                    f"leaf {base + round_ * 10 + i}": leaf.job(n=base + round_ * 10 + i)
                    for i in range(10)
                }
            )

    @sem.app.task(name="fan_in")
    def fan_in() -> None:
        calls.record("fan_in")
        calls.mark("parents", len(skiplock.parent_results()))

    wf = sem.app.workflow()
    left = wf.add(adder.job(base=0), name="left")
    right = wf.add(adder.job(base=1000), name="right")
    wf.add(fan_in.job(), name="fan_in", after=[left, right])
    ref = enqueue(sem, wf)
    workers(2, concurrency=4)
    wait_for_workflow(sem, ref.id, "completed", timeout=60)
    leaves = [key for key in calls.counts if key != "fan_in"]
    assert len(leaves) == 100 and all(calls.counts[key] == 1 for key in leaves)
    assert calls.counts["fan_in"] == 1
    assert calls.marked("parents") == {102}
