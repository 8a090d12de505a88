"""The supervisor: a service that raises is logged with its traceback, restarted with
back-off and counted, and the others run on; in a real worker the count shows in
``Worker.service_restarts``, in ``skiplock status`` and as a metric."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import psycopg
import pytest

from conftest import wait_until
from skiplock.metrics import PrometheusMetrics
from skiplock.retry import RetryPolicy
from skiplock.worker import assembly
from skiplock.worker import listener as listener_module
from skiplock.worker.leader import Promotion
from skiplock.worker.supervisor import Supervisor

from .conftest import Cli, Ops, StartWorker

QUICK = RetryPolicy(base=0.01, factor=2.0, cap=0.05, jitter=0.0)


class Flaky:
    """Raises on its first ``failures`` runs, then runs until cancelled."""

    def __init__(self, name: str, failures: int) -> None:
        self.name = name
        self.failures = failures
        self.runs = 0
        self.running = asyncio.Event()

    async def run(self) -> None:
        self.runs += 1
        if self.runs <= self.failures:
            raise RuntimeError(f"{self.name} failure {self.runs}")
        self.running.set()
        await asyncio.Event().wait()


class Ticking:
    """Counts ticks until cancelled."""

    name = "ticking"

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.001)


@pytest.mark.timeout(30)
def test_a_service_that_raises_is_logged_restarted_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="skiplock.worker.supervisor")
    restarted: list[str] = []

    async def scenario() -> tuple[dict[str, int], int, int]:
        supervisor = Supervisor(policy=QUICK, on_restart=restarted.append)
        flaky, ticking = Flaky("flaky", failures=2), Ticking()
        supervisor.start(flaky)
        supervisor.start(ticking)
        await asyncio.wait_for(flaky.running.wait(), 20)
        ticks_then = ticking.ticks
        while ticking.ticks == ticks_then:
            await asyncio.sleep(0.001)
        restarts = dict(supervisor.restarts)
        await supervisor.stop()
        assert not supervisor.running("flaky")
        assert not supervisor.running("ticking")
        return restarts, flaky.runs, ticking.ticks

    restarts, runs, ticks = asyncio.run(scenario())

    assert restarts == {"flaky": 2, "ticking": 0}
    assert runs == 3
    assert ticks > 1  # the other service ran on throughout
    assert restarted == ["flaky", "flaky"]
    failures = [r for r in caplog.records if "service flaky failed" in r.getMessage()]
    assert len(failures) == 2
    assert all(r.exc_info is not None for r in failures)  # with the traceback
    assert str(failures[0].exc_info[1]) == "flaky failure 1"  # type: ignore[index]


@pytest.mark.timeout(60)
def test_a_worker_service_that_raises_is_restarted_and_shown_in_status_and_metrics(
    ops: Ops, run_worker: StartWorker, run_cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promotion raises once (a fault injected into a real worker); it is restarted,
    promotes the job scheduled meanwhile, and the restart shows everywhere."""
    original = Promotion.run_once
    calls = 0

    async def raise_once(self: Promotion) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected fault")
        await original(self)

    monkeypatch.setattr(Promotion, "run_once", raise_once)
    ran: list[int] = []

    @ops.app.task(name="later")
    def later(n: int) -> None:
        ran.append(n)

    metrics = PrometheusMetrics(ops.url, ops.schema)
    handle = run_worker(metrics=metrics, lease_seconds=1.5)
    wait_until(lambda: handle.worker.service_restarts.get("promotion") == 1, 20, "a restart")
    with psycopg.connect(ops.url) as conn:
        later.with_options(delay=0.2).enqueue(conn, n=1)
    wait_until(lambda: ran == [1], 20, "the scheduled job to be promoted and run")

    restarts = handle.worker.service_restarts
    assert restarts["promotion"] == 1
    assert {name: n for name, n in restarts.items() if name != "promotion"} == {
        name: 0 for name in restarts if name != "promotion"
    }
    assert {"listener", "completer", "heartbeat", "election", "rescue"} <= set(restarts)
    sample = metrics.registry.get_sample_value(
        "skiplock_service_restarts_total", {"service": "promotion"}
    )
    assert sample == 1.0
    # The heartbeat reports the counts to the workers table, and status shows them.
    wait_until(
        lambda: ops.rows("SELECT service_restarts FROM {workers}") == [({"promotion": 1},)],
        20,
        "the heartbeat to report the restart",
    )
    result = run_cli("status")
    assert result.code == 0
    assert "restarts: promotion 1" in result.out


def liveness_locks(ops: Ops, worker_id: Any) -> int:
    """Listener sessions holding their share of the liveness lock of ``worker_id`` (an
    advisory lock on a bigint key: its high and low halves are classid and objid). Every
    other session of the worker holds a share too (decision 014)."""
    return int(
        ops.scalar(
            "SELECT count(*) FROM pg_locks JOIN pg_stat_activity USING (pid) "
            "WHERE locktype = 'advisory' AND granted "
            "AND objsubid = 1 AND database = (SELECT oid FROM pg_database "
            "                                 WHERE datname = current_database()) "
            "AND ((classid::bigint << 32) | objid::bigint) "
            "    = hashtextextended(%s::text, 0) "
            "AND application_name = 'skiplock listener ' || %s::text",
            (str(worker_id), str(worker_id)),
        )
    )


@pytest.mark.timeout(60)
def test_a_listener_that_raises_is_restarted_and_takes_its_liveness_lock_again(
    ops: Ops, run_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A control message that makes the listener raise (a fault injected around its
    dispatch): the listener is restarted, its liveness lock taken again on the new
    connection, so the leader never takes this worker for dead, and claims go on."""

    class Faulty(listener_module.Listener):
        # Around dispatch: dispatch itself logs and ignores what its handlers raise.
        def dispatch(self, channel: str, payload: str) -> None:
            if payload == "injected fault":
                raise RuntimeError("injected fault")
            super().dispatch(channel, payload)

    monkeypatch.setattr(assembly, "Listener", Faulty)
    ran: list[int] = []

    @ops.app.task(name="after")
    def after(n: int) -> None:
        ran.append(n)

    handle = run_worker()
    worker = handle.worker
    wait_until(lambda: liveness_locks(ops, worker.id) == 1, 10, "the liveness lock")
    ops.rows("SELECT pg_notify(%s, 'injected fault')", (f"{ops.schema}.control",))

    wait_until(lambda: worker.service_restarts.get("listener") == 1, 20, "a restart")
    wait_until(lambda: liveness_locks(ops, worker.id) == 1, 20, "the lock taken again")
    with psycopg.connect(ops.url) as conn:
        after.enqueue(conn, n=1)
    wait_until(lambda: ran == [1], 20, "a job claimed after the restart")
    # The worker's other sessions held the liveness lock while the listener was down
    # (decision 014), so its registration was kept.
    wait_until(
        lambda: ops.rows("SELECT id FROM {workers}") == [(worker.id,)], 10, "its registration"
    )


@pytest.mark.timeout(60)
def test_claims_wait_while_the_listener_is_down(
    ops: Ops, run_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the listener cannot be restarted (each start fails), producers do not claim:
    the worker never runs jobs without its liveness lock. Claims resume once it is up."""
    failing = threading.Event()
    blocked_starts = 0

    class Faulty(listener_module.Listener):
        async def run(self) -> None:
            nonlocal blocked_starts
            if failing.is_set():
                blocked_starts += 1
                raise RuntimeError("listener cannot start")
            await super().run()

        def dispatch(self, channel: str, payload: str) -> None:
            if payload == "injected fault":
                failing.set()
                raise RuntimeError("injected fault")
            super().dispatch(channel, payload)

    monkeypatch.setattr(assembly, "Listener", Faulty)
    ran: list[int] = []

    @ops.app.task(name="blocked")
    def blocked(n: int) -> None:
        ran.append(n)

    handle = run_worker(poll_interval=0.02)
    worker = handle.worker
    ops.rows("SELECT pg_notify(%s, 'injected fault')", (f"{ops.schema}.control",))
    # Three failed starts: the lock is gone and producers have polled many times over.
    wait_until(lambda: blocked_starts >= 3, 20, "failed listener starts")
    assert liveness_locks(ops, worker.id) == 0
    with psycopg.connect(ops.url) as conn:
        job = blocked.enqueue(conn, n=1)
    wait_until(lambda: blocked_starts >= 5, 20, "more failed listener starts")
    assert ran == []
    assert ops.state_of(job) == "available"

    failing.clear()
    wait_until(lambda: ran == [1], 30, "the job claimed once the listener is back")
    assert liveness_locks(ops, worker.id) == 1
