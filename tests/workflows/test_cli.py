"""``skiplock workflows list | show | cancel``."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import pytest

import skiplock
from conftest import wait_until
from semantics.conftest import CliResult
from workflows.conftest import RunCli, Sem, StartWorkers
from workflows.helpers import enqueue, step_states, workflow_state


def _waiting_chain(sem: Sem) -> skiplock.WorkflowRef:
    @sem.app.task(name="noop")
    def noop() -> None: ...

    wf = sem.app.workflow("nightly")
    first = wf.add(noop.job(), name="fetch")
    second = wf.add(noop.job(), name="parse", after=[first])
    wf.add(noop.job(), name="render", after=[first, second])
    return enqueue(sem, wf)


def test_list_and_show(sem: Sem, run_cli: RunCli) -> None:
    ref = _waiting_chain(sem)
    listed = run_cli("workflows", "list")
    assert listed.code == 0
    assert f"{ref.id:>8}  running" in listed.out and "nightly" in listed.out
    shown = run_cli("workflows", "show", str(ref.id))
    assert shown.code == 0
    lines = shown.out.splitlines()
    assert lines[0] == f"workflow {ref.id} 'nightly': running, 0/3 steps ended"
    assert lines[2].startswith("  fetch [available]")
    assert lines[3].startswith("    parse [waiting]")
    assert lines[4].startswith("    render [waiting]") and "also after parse" in lines[4]
    as_json = json.loads(run_cli("workflows", "show", str(ref.id), "--json").out)
    assert [step["name"] for step in as_json["steps"]] == ["fetch", "parse", "render"]


def test_status_counts_waiting_steps(sem: Sem, run_cli: RunCli) -> None:
    _waiting_chain(sem)
    status = json.loads(run_cli("status", "--json").out)
    default = next(q for q in status["queues"] if q["queue"] == "default")
    assert (default["waiting"], default["available"]) == (2, 1)
    table = run_cli("status").out.splitlines()
    assert table[0].split()[:3] == ["queue", "waiting", "blocked"]
    assert next(line for line in table if line.startswith("default")).split()[1:4] == [
        "2",
        "0",
        "1",
    ]


def test_jobs_show_names_the_workflow_and_the_steps_around_it(sem: Sem, run_cli: RunCli) -> None:
    ref = _waiting_chain(sem)
    render_id = int(ref.steps["render"])
    shown = run_cli("jobs", "show", str(render_id)).out.splitlines()
    at = shown.index(f"workflow: {ref.id} 'nightly' (running), step 'render', 3 of 3")
    assert shown[at + 1 :] == ["  after: fetch, parse", "  waiting for 2 more"]
    fetch = run_cli("jobs", "show", str(int(ref.steps["fetch"]))).out.splitlines()
    assert fetch[-1] == "  before: parse, render"
    as_json = json.loads(run_cli("jobs", "show", str(render_id), "--json").out)
    assert as_json["step"]["workflow_id"] == ref.id
    assert (as_json["step"]["parents"], as_json["step"]["pending"]) == (["fetch", "parse"], 2)

    @sem.app.task(name="alone")
    def alone() -> None: ...

    plain = sem.enqueue(alone)
    assert json.loads(run_cli("jobs", "show", str(plain), "--json").out)["step"] is None
    assert not any(
        line.startswith("workflow:")
        for line in run_cli("jobs", "show", str(plain)).out.splitlines()
    )


def test_cancel_ends_every_step_and_the_workflow(sem: Sem, run_cli: RunCli) -> None:
    ref = _waiting_chain(sem)
    result = run_cli("workflows", "cancel", str(ref.id))
    assert result.code == 0
    assert "3 steps cancelled or asked to stop" in result.out
    assert workflow_state(sem, ref.id) == "cancelled"
    assert set(step_states(sem, ref.id).values()) == {"cancelled"}
    again = run_cli("workflows", "cancel", str(ref.id))
    assert again.code == 1 and "has ended (cancelled)" in again.out
    missing = run_cli("workflows", "show", "999999")
    assert missing.code != 0


# Fragments of the statements that meet: a cancel's (of waiting jobs, or its lock of
# their steps first), a lease completion's.
CANCEL = ("state IN ('waiting', 'blocked', 'scheduled'", "workflow_steps_lock(")
COMPLETION = ("WITH durable AS",)


def _lock_waiter(sem: Sem, statements: tuple[str, ...]) -> bool:
    """True while a session runs one of this schema's ``statements`` (a fragment of its
    text) and waits for a row lock another transaction holds."""
    rows = sem.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE %s AND query LIKE ANY(%s)",
        (f"%{sem.schema}%", [f"%{s}%" for s in statements]),
    )
    return int(rows[0][0]) > 0


@dataclass
class _Meeting:
    """A workflow whose first step runs until ``release`` is set, and a step after it in
    a queue no worker serves (released, it stays where a cancel finds it)."""

    ref: skiplock.WorkflowRef
    slow_id: int
    after_id: int
    release: threading.Event


def _meeting(sem: Sem, workers: StartWorkers) -> _Meeting:
    release = threading.Event()

    @sem.app.task(name="slow")
    def slow() -> None:
        release.wait(30)

    @sem.app.task(name="noop", queue="elsewhere")
    def noop() -> None: ...

    wf = sem.app.workflow()
    first = wf.add(slow.job(), name="slow")
    wf.add(noop.job(), name="after", after=[first])
    ref = enqueue(sem, wf)
    meeting = _Meeting(ref, int(ref.steps["slow"]), int(ref.steps["after"]), release)
    workers(1)
    sem.wait_for_state(meeting.slow_id, "running")
    return meeting


def _cli_in_thread(run_cli: RunCli, *args: str) -> tuple[threading.Thread, list[CliResult]]:
    results: list[CliResult] = []
    thread = threading.Thread(target=lambda: results.append(run_cli(*args)))
    thread.start()
    return thread, results


def _deadlocks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deadlock" in r.getMessage()]


def test_cancelling_a_workflow_while_one_of_its_steps_ends_deadlocks_neither(
    sem: Sem, workers: StartWorkers, run_cli: RunCli, caplog: pytest.LogCaptureFixture
) -> None:
    """The cancel and the completion of a running step meet on the same rows, whichever
    is first: each waits for the other's commit, neither for a lock the other waits
    behind (PostgreSQL would break such a cycle by failing one of them)."""
    m = _meeting(sem, workers)
    caplog.set_level(logging.WARNING)
    # The waiting step's job held, the cancel stops there; the running step then ends,
    # and its completion stops too, behind one or the other.
    with sem.connect(autocommit=False) as holder:
        holder.execute(f'SELECT FROM "{sem.schema}".jobs WHERE id = %s FOR UPDATE', (m.after_id,))
        cancel, results = _cli_in_thread(run_cli, "workflows", "cancel", str(m.ref.id))
        wait_until(lambda: _lock_waiter(sem, CANCEL), 15, "the cancel to wait for the row")
        m.release.set()
        wait_until(lambda: _lock_waiter(sem, COMPLETION), 15, "the completion to wait")
        holder.rollback()
    cancel.join(30)

    assert len(results) == 1, "the cancel did not return"
    assert results[0].code == 0, results[0]
    sem.wait_for_state(m.slow_id, "completed", "cancelled")
    assert _deadlocks(caplog) == []
    assert workflow_state(sem, m.ref.id) == "cancelled"
    assert sem.state_of(m.after_id) == "cancelled"


def test_cancelling_a_waiting_step_while_its_parent_releases_it_deadlocks_neither(
    sem: Sem, workers: StartWorkers, run_cli: RunCli, caplog: pytest.LogCaptureFixture
) -> None:
    """A completion counts a child (its step's row) before it releases it (its job's);
    a cancel of the waiting child takes them in that order too."""
    m = _meeting(sem, workers)
    caplog.set_level(logging.WARNING)
    # The waiting step's row held, the parent's completion stops at its count; the
    # cancel of that step by hand comes next and stops too.
    with sem.connect(autocommit=False) as holder:
        holder.execute(
            f'SELECT FROM "{sem.schema}".workflow_steps WHERE job_id = %s FOR UPDATE',
            (m.after_id,),
        )
        m.release.set()
        wait_until(lambda: _lock_waiter(sem, COMPLETION), 15, "the completion to wait")
        cancel, results = _cli_in_thread(run_cli, "jobs", "cancel", str(m.after_id))
        wait_until(lambda: _lock_waiter(sem, CANCEL), 15, "the cancel to wait")
        holder.rollback()
    cancel.join(30)

    assert len(results) == 1, "the cancel did not return"
    assert results[0].code == 0, results[0]
    sem.wait_for_state(m.slow_id, "completed")
    assert _deadlocks(caplog) == []
    assert sem.state_of(m.after_id) == "cancelled"
    assert workflow_state(sem, m.ref.id) == "failed"
