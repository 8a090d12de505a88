"""Running a finished job again (issue 25, item 12): ``jobs retry`` on a completed or
cancelled job in history enqueues a copy that names the original, alone or by filter,
from the CLI and the admin API; history keeps the original as it ended."""

from __future__ import annotations

from typing import Any

import skiplock
from conftest import wait_until

from .conftest import Cli, Ops, StartWorker


def live(ops: Ops, job_id: int) -> dict[str, Any]:
    rows = ops.rows(
        "SELECT state, task, queue, args, priority, max_attempts, attempts, meta, ordering_key "
        "FROM {jobs} WHERE id = %s",
        (job_id,),
    )
    keys = ("state", "task", "queue", "args", "priority", "max_attempts", "attempts", "meta")
    assert rows, f"job {job_id} is not in the jobs table"
    return dict(zip((*keys, "ordering_key"), rows[0], strict=True))


def finished(ops: Ops, state: str, **values: Any) -> int:
    """A finished job written into history by hand, with arguments, a priority and a key."""
    (job_id,) = ops.history(state=state, queue="mail", task="shop.send")
    ops.rows(
        "UPDATE {history} SET args = %(args)s::jsonb, priority = 3, max_attempts = 7, "
        "ordering_key = %(key)s WHERE id = %(id)s",
        {"args": '{"order_id": 42}', "key": values.get("key"), "id": job_id},
    )
    return job_id


def test_retry_on_a_completed_job_enqueues_a_copy_naming_it(ops: Ops, run_cli: Cli) -> None:
    original = finished(ops, "completed")

    result = run_cli("jobs", "retry", str(original))

    assert result.code == 0, result.err
    copy = int(result.out.rsplit(" ", 1)[1])
    assert result.out == f"job {original} (completed) enqueued again as job {copy}\n"
    assert copy != original
    assert live(ops, copy) == {
        "state": "available",
        "task": "shop.send",
        "queue": "mail",
        "args": {"order_id": 42},
        "priority": 3,
        "max_attempts": 7,
        "attempts": 0,
        "meta": {"replay_of": original},
        "ordering_key": None,
    }
    assert ops.rows("SELECT state FROM {history} WHERE id = %s", (original,)) == [("completed",)]


def test_a_cancelled_one_too_and_its_key_goes_with_it(ops: Ops, run_cli: Cli) -> None:
    original = finished(ops, "cancelled", key="customer:9")

    result = run_cli("jobs", "retry", str(original))

    copy = int(result.out.rsplit(" ", 1)[1])
    assert result.out == f"job {original} (cancelled) enqueued again as job {copy}\n"
    replayed = live(ops, copy)
    assert replayed["ordering_key"] == "customer:9"
    # A keyed job waits its key's turn outside the claim (the enqueue's own admission).
    assert replayed["state"] in ("blocked", "available")


def test_replay_by_filter_asks_first_and_names_what_it_did(ops: Ops, run_cli: Cli) -> None:
    done = [finished(ops, "completed") for _ in range(3)]
    finished(ops, "cancelled")
    (elsewhere,) = ops.history(state="completed", queue="other")

    declined = run_cli(
        "jobs", "retry", "--all", "--state", "completed", "--queue", "mail", answer="n"
    )
    assert declined.out == "retry 3 jobs? [y/N] nothing changed\n"
    assert ops.count("jobs") == 0

    result = run_cli("jobs", "retry", "--all", "--state", "completed", "--queue", "mail", "--yes")

    assert result.out == ("3 of 3 jobs enqueued again (copies; history keeps the originals)\n"), (
        result.err
    )
    replay_of = ops.rows("SELECT (meta->>'replay_of')::bigint FROM {jobs} ORDER BY 1")
    assert [r[0] for r in replay_of] == done
    assert elsewhere not in [r[0] for r in replay_of]


def test_the_admin_api_returns_the_copy_that_runs_and_a_worker_runs_it(
    ops: Ops, run_worker: StartWorker
) -> None:
    app = skiplock.App(ops.url, schema=ops.schema)

    @app.task(name="replay.double")
    def double(n: int) -> int:
        return 2 * n

    with app.connect() as conn:
        first = double.enqueue(conn, n=21)
    run_worker(app)
    wait_until(lambda: ops.state_of(first) == "completed", 30, what="the first run")

    with app.connect(autocommit=True) as conn:
        admin = skiplock.Admin(app, conn)
        again = admin.retry_job(first)

        assert again != first
        wait_until(lambda: ops.state_of(again) == "completed", 30, what="the replay")
        results = ops.rows("SELECT id, result, meta FROM {history} ORDER BY id")
        assert results == [(first, 42, None), (again, 42, {"replay_of": first})]
        assert admin.job_ids(state="completed") == [first, again]
        # A dead job is retried in place, as before: the id that runs is its own.
        dead = ops.job(state="dead", task="replay.double", args={"n": 1}, attempts=3)
        assert admin.retry_job(dead) == dead


def test_a_job_still_running_is_not_replayed(ops: Ops, run_cli: Cli) -> None:
    running = ops.job(state="running")

    result = run_cli("jobs", "retry", str(running))

    assert result.code == 2
    assert result.err == (
        f"skiplock: job {running} is running; only jobs not running can be retried\n"
    )
    assert ops.count("jobs") == 1
