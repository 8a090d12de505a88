"""Steering jobs and queues by hand: ``skiplock jobs`` and ``skiplock queues``.

Every command meets a job in every state; bulk forms select with filters and ask before
changing anything; a paused queue is skipped by a real worker's claims, both lease and
transactional, until it is resumed.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import Listener, wait_until
from skiplock import client

from .conftest import Cli, Ops, StartWorker

WAITING = ["scheduled", "available", "retryable", "dead"]
STATES = [*WAITING, "running"]


def job_in(ops: Ops, state: str, **options: Any) -> int:
    """A job in ``state`` with the timestamps that state has; one failure on record."""
    if state == "scheduled":
        return ops.job(state=state, run_at=3600, **options)
    if state == "retryable":
        return ops.job(
            state=state,
            run_at=-60,
            retry_at=600,
            attempts=1,
            attempted_at=-30,
            errors=[ops.error(-30)],
            **options,
        )
    if state == "dead":
        return ops.job(
            state=state,
            run_at=-60,
            attempts=3,
            attempted_at=-30,
            errors=[ops.error(-30)],
            **options,
        )
    return ops.job(state=state, run_at=-60, **options)


def row(ops: Ops, job_id: int) -> dict[str, Any] | None:
    rows = ops.rows(
        "SELECT state, attempts, errors, retry_at, run_at, cancel_requested_at, "
        "retry_at <= now() AS due FROM {jobs} WHERE id = %s",
        (job_id,),
    )
    if not rows:
        return None
    keys = ("state", "attempts", "errors", "retry_at", "run_at", "cancel_requested_at", "due")
    return dict(zip(keys, rows[0], strict=True))


def in_history(ops: Ops, job_id: int) -> str | None:
    rows = ops.rows("SELECT state FROM {history} WHERE id = %s", (job_id,))
    return None if not rows else str(rows[0][0])


# -- one job at a time -----------------------------------------------------------------


@pytest.mark.parametrize("state", WAITING)
def test_retry_a_waiting_or_dead_job(ops: Ops, run_cli: Cli, state: str) -> None:
    job_id = job_in(ops, state)
    errors_before = (row(ops, job_id) or {})["errors"]

    result = run_cli("jobs", "retry", str(job_id))

    assert (result.code, result.out) == (0, f"job {job_id} made available again\n")
    after = row(ops, job_id)
    assert after is not None
    assert after["state"] == "available"
    assert after["attempts"] == 0  # a fresh set of attempts
    assert after["errors"] == errors_before  # what went wrong is kept
    assert after["due"] is True


def test_retrying_a_scheduled_job_makes_it_claimable_now(ops: Ops, run_cli: Cli) -> None:
    job_id = job_in(ops, "scheduled")

    assert run_cli("jobs", "retry", str(job_id)).code == 0

    assert ops.scalar("SELECT run_at <= now() FROM {jobs} WHERE id = %s", (job_id,)) is True


@pytest.mark.parametrize("transactional", [False, True], ids=["lease", "transactional"])
def test_a_retried_scheduled_job_is_run_now_by_a_running_worker(
    ops: Ops, run_cli: Cli, run_worker: StartWorker, transactional: bool
) -> None:
    """Not only due on paper: a worker that is already running (its claim cursor past
    the job's id, nothing else to do) runs it at once."""
    runs: list[int] = []

    def record() -> None:
        runs.append(skiplock.current_job().id)

    if transactional:

        @ops.app.task(name="later", transactional=True)
        def later_in_a_transaction(conn: psycopg.Connection[Any]) -> None:
            record()
    else:

        @ops.app.task(name="later")
        def later() -> None:
            record()

    first = ops.job(task="later", run_at=-1)
    run_worker()
    wait_until(lambda: runs == [first], what="the worker to run a first job")
    job_id = job_in(ops, "scheduled", task="later")  # an hour from now

    assert run_cli("jobs", "retry", str(job_id)).code == 0

    wait_until(lambda: runs == [first, job_id], what="the retried scheduled job to run")


def test_a_retried_dead_job_keeps_its_place_in_line(ops: Ops, run_cli: Cli) -> None:
    """Decision 008: only a future run_at comes to now; a past one is the job's place."""
    job_id = job_in(ops, "dead")
    run_at = ops.scalar("SELECT run_at FROM {jobs} WHERE id = %s", (job_id,))

    assert run_cli("jobs", "retry", str(job_id)).code == 0

    assert ops.scalar("SELECT run_at FROM {jobs} WHERE id = %s", (job_id,)) == run_at


@pytest.mark.parametrize("state", WAITING)
def test_cancel_a_waiting_or_dead_job_moves_it_to_history(
    ops: Ops, run_cli: Cli, state: str
) -> None:
    job_id = job_in(ops, state)

    result = run_cli("jobs", "cancel", str(job_id))

    assert (result.code, result.out) == (0, f"job {job_id} cancelled\n")
    assert row(ops, job_id) is None
    assert in_history(ops, job_id) == "cancelled"


@pytest.mark.parametrize("state", WAITING)
def test_delete_a_waiting_or_dead_job_leaves_no_trace(ops: Ops, run_cli: Cli, state: str) -> None:
    job_id = job_in(ops, state)

    result = run_cli("jobs", "delete", str(job_id))

    assert (result.code, result.out) == (0, f"job {job_id} deleted\n")
    assert ops.state_of(job_id) is None


@pytest.mark.parametrize(("command", "verb"), [("retry", "retried"), ("delete", "deleted")])
def test_retry_and_delete_refuse_a_running_job(
    ops: Ops, run_cli: Cli, command: str, verb: str
) -> None:
    job_id = job_in(ops, "running")
    before = row(ops, job_id)

    result = run_cli("jobs", command, str(job_id))

    assert result.code == 2
    assert result.err == (
        f"skiplock: job {job_id} is running; only jobs not running can be {verb}\n"
    )
    assert row(ops, job_id) == before


def test_cancel_a_running_job_asks_its_worker_to_stop_it(ops: Ops, run_cli: Cli) -> None:
    job_id = job_in(ops, "running")
    listener = Listener(ops.url, f"{ops.schema}.control")
    try:
        result = run_cli("jobs", "cancel", str(job_id))

        assert result.code == 0
        after = row(ops, job_id)
        assert after is not None
        assert after["state"] == "running"  # its worker records the cancellation
        assert after["cancel_requested_at"] is not None
        assert listener.collect() == ["cancel"]  # the verb; the job id follows a tab
    finally:
        listener.close()


def test_a_cancelled_job_whose_worker_died_is_not_run_again(
    ops: Ops, run_cli: Cli, run_worker: StartWorker
) -> None:
    runs: list[int] = []

    @ops.app.task(name="victim")
    def victim() -> None:
        runs.append(skiplock.current_job().id)

    job_id = ops.job(task="victim", state="running", lease_expires_at=-1)  # its worker is gone
    assert run_cli("jobs", "cancel", str(job_id)).code == 0

    run_worker()
    wait_until(lambda: in_history(ops, job_id) is not None, what="the job to finish")

    assert (in_history(ops, job_id), runs) == ("cancelled", [])


@pytest.mark.parametrize(("command", "verb"), [("cancel", "cancelled"), ("delete", "deleted")])
def test_finished_jobs_are_not_in_the_hot_table(
    ops: Ops, run_cli: Cli, command: str, verb: str
) -> None:
    (job_id,) = ops.history(finished_at=-10)

    result = run_cli("jobs", command, str(job_id))

    assert result.code == 2
    assert result.err.startswith(f"skiplock: job {job_id} has finished (completed)")
    assert in_history(ops, job_id) == "completed"
    assert ops.count("jobs") == 0


@pytest.mark.parametrize("command", ["retry", "cancel", "delete", "show"])
def test_a_job_that_never_existed(ops: Ops, run_cli: Cli, command: str) -> None:
    result = run_cli("jobs", command, "987654321")

    assert (result.code, result.err) == (2, "skiplock: no job with id 987654321\n")


def test_show_a_live_and_a_finished_job(ops: Ops, run_cli: Cli) -> None:
    live = job_in(ops, "dead", queue="mail", task="send")
    (finished,) = ops.history(queue="mail", task="send", finished_at=-10)

    shown = json.loads(run_cli("jobs", "show", str(live), "--json").out)
    done = json.loads(run_cli("jobs", "show", str(finished), "--json").out)

    assert (shown["id"], shown["state"], shown["queue"], shown["task"]) == (
        live,
        "dead",
        "mail",
        "send",
    )
    assert shown["errors"][0]["message"] == "boom"
    assert shown["finished_at"] == "-"
    assert (done["id"], done["state"]) == (finished, "completed")
    assert done["finished_at"] != "-"


# -- many jobs at once -----------------------------------------------------------------


def stage_bulk(ops: Ops) -> dict[str, list[int]]:
    """Dead jobs in two queues and two tasks, waiting ones, a running one, an old one."""
    return {
        "dead_a_t1": [job_in(ops, "dead", queue="a", task="t1") for _ in range(2)],
        "dead_a_t2": [job_in(ops, "dead", queue="a", task="t2")],
        "dead_b": [job_in(ops, "dead", queue="b", task="t1")],
        "available_b": [job_in(ops, "available", queue="b", task="t1")],
        "old_b": [ops.job(queue="b", task="t1", created_at=-7200, run_at=-7200)],
        "running_b": [job_in(ops, "running", queue="b", task="t1")],
    }


def states(ops: Ops, ids: list[int]) -> list[str | None]:
    return [ops.state_of(i) for i in ids]


def test_list_with_filters(ops: Ops, run_cli: Cli) -> None:
    jobs = stage_bulk(ops)

    def listed(*filters: str) -> list[int]:
        result = run_cli("jobs", "list", "--json", *filters)
        assert result.code == 0
        return [j["id"] for j in json.loads(result.out)]

    assert listed("--state", "dead", "--queue", "a") == jobs["dead_a_t1"] + jobs["dead_a_t2"]
    assert listed("--state", "dead", "--task", "t1") == jobs["dead_a_t1"] + jobs["dead_b"]
    assert listed("--older-than", "3600") == jobs["old_b"]
    assert listed("--state", "running") == jobs["running_b"]
    assert len(listed("--limit", "3")) == 3
    assert listed("--queue", "nowhere") == []


def test_list_as_a_table(ops: Ops, run_cli: Cli) -> None:
    job_id = job_in(ops, "dead", queue="a", task="t1")

    lines = run_cli("jobs", "list").out.splitlines()

    assert lines[0].split() == ["id", "state", "queue", "attempts", "task", "/", "last", "error"]
    assert lines[1].split() == [str(job_id), "dead", "a", "3/3", "t1", "[ValueError:", "boom]"]


def test_bulk_retry_with_filters(ops: Ops, run_cli: Cli) -> None:
    jobs = stage_bulk(ops)
    listener = Listener(ops.url, f"{ops.schema}.jobs")
    try:
        result = run_cli("jobs", "retry", "--all", "--state", "dead", "--queue", "a", "--yes")

        assert (result.code, result.out) == (0, "3 of 3 jobs made available again\n")
        assert listener.collect() == ["a"]  # one wake-up for the queue
    finally:
        listener.close()
    assert states(ops, jobs["dead_a_t1"] + jobs["dead_a_t2"]) == ["available"] * 3
    assert states(ops, jobs["dead_b"]) == ["dead"]


def test_bulk_cancel_by_task_and_age(ops: Ops, run_cli: Cli) -> None:
    jobs = stage_bulk(ops)

    by_task = run_cli("jobs", "cancel", "--all", "--task", "t2", "--yes")
    by_age = run_cli("jobs", "cancel", "--all", "--older-than", "3600", "--yes")

    assert by_task.out == by_age.out == "1 of 1 job cancelled\n"
    assert [in_history(ops, i) for i in jobs["dead_a_t2"] + jobs["old_b"]] == ["cancelled"] * 2
    assert states(ops, jobs["dead_a_t1"]) == ["dead", "dead"]


def test_bulk_delete_leaves_running_jobs_alone(ops: Ops, run_cli: Cli) -> None:
    jobs = stage_bulk(ops)

    result = run_cli("jobs", "delete", "--all", "--queue", "b", "--yes")

    assert (result.code, result.out) == (0, "3 of 4 jobs deleted (the rest were running)\n")
    assert states(ops, jobs["dead_b"] + jobs["available_b"] + jobs["old_b"]) == [None] * 3
    assert states(ops, jobs["running_b"]) == ["running"]


def test_bulk_without_yes_and_without_a_terminal_changes_nothing(ops: Ops, run_cli: Cli) -> None:
    jobs = stage_bulk(ops)
    every = [i for ids in jobs.values() for i in ids]
    before = states(ops, every)

    for command in ("retry", "cancel", "delete"):
        result = run_cli("jobs", command, "--all", "--state", "dead")

        assert result.code == 2
        assert result.err == (
            f"skiplock: 4 jobs match; pass --yes to {command} them without a prompt\n"
        )
    assert states(ops, every) == before


def test_bulk_asks_on_a_terminal(ops: Ops, run_cli: Cli) -> None:
    jobs = stage_bulk(ops)

    declined = run_cli("jobs", "delete", "--all", "--state", "dead", answer="n")

    assert declined.code == 1
    assert declined.out == "delete 4 jobs? [y/N] nothing changed\n"
    assert states(ops, jobs["dead_b"]) == ["dead"]

    accepted = run_cli("jobs", "delete", "--all", "--state", "dead", answer="y")

    assert accepted.code == 0
    assert accepted.out == "delete 4 jobs? [y/N] 4 of 4 jobs deleted\n"
    assert ops.count("jobs", "state = 'dead'") == 0


def test_bulk_with_nothing_matching(ops: Ops, run_cli: Cli) -> None:
    stage_bulk(ops)

    result = run_cli("jobs", "retry", "--all", "--queue", "nowhere")

    assert (result.code, result.out) == (0, "no jobs match\n")


def test_bulk_needs_an_id_or_all_but_not_both(ops: Ops, run_cli: Cli) -> None:
    job_id = job_in(ops, "dead")

    both = run_cli("jobs", "retry", str(job_id), "--all")
    neither = run_cli("jobs", "cancel", "--state", "dead")

    assert (both.code, both.err) == (
        2,
        "skiplock: give a job id or --all with filters, not both\n",
    )
    assert neither.code == 2
    assert "needs a job id, or --all with filters" in neither.err
    assert ops.state_of(job_id) == "dead"


def test_client_bulk_functions_count_what_they_changed(ops: Ops) -> None:
    jobs = stage_bulk(ops)

    with ops.connect() as conn:
        dead = client.select_job_ids(conn, ops.schema, state="dead")
        assert dead == sorted(jobs["dead_a_t1"] + jobs["dead_a_t2"] + jobs["dead_b"])
        assert client.retry_jobs(conn, ops.schema, [*dead, *jobs["running_b"]]) == 4
        waiting_b = client.select_job_ids(conn, ops.schema, queue="b", state="available")
        assert client.delete_jobs(conn, ops.schema, [*waiting_b, *jobs["running_b"]]) == 3
        assert client.cancel_jobs(conn, ops.schema, jobs["dead_a_t1"]) == 2
        assert [j.id for j in client.list_jobs(conn, ops.schema, limit=10)] == sorted(
            jobs["dead_a_t2"] + jobs["running_b"]
        )


# -- queues ----------------------------------------------------------------------------


def listed_states(out: str) -> dict[str, str]:
    """``queues list``: each queue's state column."""
    return {line.split()[0]: line.split()[1] for line in out.splitlines()[1:]}


def test_pause_resume_and_list_queues(ops: Ops, run_cli: Cli) -> None:
    assert run_cli("queues", "list").out.startswith("no queues yet")

    assert run_cli("queues", "pause", "mail").out == "queue mail paused: no new claims\n"
    assert run_cli("queues", "pause", "sms").out == "queue sms paused: no new claims\n"
    assert run_cli("queues", "pause", "mail").code == 0  # pausing twice is fine
    assert listed_states(run_cli("queues", "list").out) == {"mail": "paused", "sms": "paused"}

    assert run_cli("queues", "resume", "mail").out == "queue mail resumed\n"
    assert listed_states(run_cli("queues", "list").out) == {"mail": "active", "sms": "paused"}
    with ops.connect() as conn:
        assert client.paused_queues(conn, ops.schema) == ["sms"]


def test_a_bad_queue_name_is_refused(ops: Ops, run_cli: Cli) -> None:
    result = run_cli("queues", "pause", "no spaces")

    assert result.code == 2
    assert "may only contain letters, digits" in result.err
    assert ops.count("queues") == 0


def test_resume_wakes_the_queue_when_jobs_wait(ops: Ops) -> None:
    ops.job(queue="mail")
    listener = Listener(ops.url, f"{ops.schema}.jobs")
    try:
        with ops.connect() as conn:
            client.set_queue_paused(conn, ops.schema, "mail", paused=True)
            client.set_queue_paused(conn, ops.schema, "idle", paused=False)
            assert listener.collect() == []  # pausing wakes no one; nothing waits on idle
            client.set_queue_paused(conn, ops.schema, "mail", paused=False)
        assert listener.collect() == ["mail"]
    finally:
        listener.close()


def test_a_worker_claims_nothing_from_a_paused_queue_until_it_resumes(
    ops: Ops, run_worker: StartWorker
) -> None:
    app = ops.app

    @app.task(name="held.leased", queue="held")
    def held_leased() -> None:
        return None

    @app.task(name="held.transactional", queue="held", transactional=True)
    def held_transactional(conn: Any) -> None:
        return None

    @app.task(name="flowing", queue="flowing")
    def flowing() -> None:
        return None

    with ops.connect() as conn:
        client.set_queue_paused(conn, ops.schema, "held", paused=True)
    with ops.connect(autocommit=False) as conn:
        held = [int(held_leased.enqueue(conn)), int(held_transactional.enqueue(conn))]
        conn.commit()
    run_worker(app, queues=["held", "flowing"])

    with ops.connect(autocommit=False) as conn:
        other = int(flowing.enqueue(conn))
        conn.commit()
    wait_until(lambda: ops.state_of(other) == "completed", what="the other queue's job")

    assert states(ops, held) == ["available", "available"]
    assert ops.count("jobs", "id = ANY(%s) AND attempts = 0", (held,)) == 2

    with ops.connect() as conn:
        client.set_queue_paused(conn, ops.schema, "held", paused=False)
    wait_until(
        lambda: states(ops, held) == ["completed", "completed"], what="the resumed queue's jobs"
    )
