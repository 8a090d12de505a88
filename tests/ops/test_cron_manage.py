"""Cron schedules managed at run time (issue 25, item 13): the workers that tick a schedule
describe it in the database (migration 0030), so ``skiplock cron list | pause | resume |
run-now`` and the dashboard's cron page need no App; a paused schedule's ticks pass
without jobs and none are owed when it resumes."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import skiplock

from .conftest import Cli, Ops
from .test_periodic import FIRST_SEEN, enqueue_due_from, enqueued, report_app

LATER = datetime(2025, 6, 1, 12, 5, 1, tzinfo=UTC)  # the 12:05 tick is due
LATER_STILL = datetime(2025, 6, 1, 12, 10, 1, tzinfo=UTC)  # and 12:10's


def test_a_worker_describes_the_schedules_it_ticks(ops: Ops, run_cli: Cli) -> None:
    enqueue_due_from(report_app(ops), FIRST_SEEN)

    listed = json.loads(run_cli("cron", "list", "--json").out)

    assert len(listed) == 1
    (schedule,) = listed
    assert {k: schedule[k] for k in ("name", "expression", "task", "queue", "args", "missed")} == {
        "name": "report",
        "expression": "*/5 * * * *",
        "task": "report",
        "queue": "reports",
        "args": {"kind": "daily"},
        "missed": "latest",
    }
    assert schedule["paused"] is False
    assert schedule["next_tick"].startswith("2025-06-01 12:05:00")
    table = run_cli("cron", "list").out.splitlines()
    assert table[1].split()[:3] == ["report", "*/5", "*"]
    assert "2025-06-01T12:05:00+00:00 / 2025-06-01T12:00:30+00:00" in table[1]


def test_a_description_follows_the_app_after_a_deploy(ops: Ops) -> None:
    enqueue_due_from(report_app(ops), FIRST_SEEN)

    enqueue_due_from(report_app(ops, cron="*/7 * * * *"), FIRST_SEEN)

    assert ops.rows("SELECT expression FROM {periodic}") == [("*/7 * * * *",)]


def test_a_paused_schedule_skips_its_ticks_and_owes_none_on_resume(ops: Ops, run_cli: Cli) -> None:
    app = report_app(ops, missed="all")
    enqueue_due_from(app, FIRST_SEEN)

    paused = run_cli("cron", "pause", "report")
    assert (paused.code, paused.out) == (
        0,
        "schedule report paused: its ticks enqueue nothing until resumed\n",
    )
    assert enqueue_due_from(app, LATER) == [0]  # the 12:05 tick passes without a job
    assert "PAUSED" in run_cli("cron", "list").out

    resumed = run_cli("cron", "resume", "report")
    assert resumed.out == "schedule report resumed: its next tick enqueues its job\n"
    # missed="all" would catch up on 12:05: a paused tick is skipped, not owed.
    assert enqueue_due_from(app, LATER_STILL) == [1]
    assert [row[4] for row in enqueued(ops)] == [datetime(2025, 6, 1, 12, 10, tzinfo=UTC)]


def test_run_now_enqueues_the_described_job_without_the_app(ops: Ops, run_cli: Cli) -> None:
    enqueue_due_from(report_app(ops), FIRST_SEEN)
    run_cli("cron", "pause", "report")

    result = run_cli("cron", "run-now", "report")

    assert result.code == 0, result.err
    job_id = int(result.out.split()[3])
    assert result.out == f"schedule report: job {job_id} enqueued now\n"
    assert ops.rows("SELECT task, queue, args, state FROM {jobs} WHERE id = %s", (job_id,)) == [
        ("report", "reports", {"kind": "daily"}, "available")
    ]


def test_run_now_enqueues_the_job_a_tick_would_tags_included(ops: Ops, run_cli: Cli) -> None:
    app = skiplock.App(ops.url, schema=ops.schema)

    @app.periodic("*/5 * * * *", name="tagged", tags=["reports", "nightly"])
    def tagged() -> None:
        return None

    enqueue_due_from(app, FIRST_SEEN)
    enqueue_due_from(app, LATER)  # the 12:05 tick
    result = run_cli("cron", "run-now", "tagged")

    assert result.code == 0, result.err
    job_id = int(result.out.split()[3])
    rows = ops.rows("SELECT id, meta -> 'tags' FROM {jobs} ORDER BY id")
    assert [tags for _, tags in rows] == [["reports", "nightly"]] * 2
    assert rows[-1][0] == job_id
    assert json.loads(run_cli("cron", "list", "--json").out)[0]["tags"] == ["reports", "nightly"]


def test_run_now_of_a_row_written_by_hand_takes_the_jobs_defaults(ops: Ops, run_cli: Cli) -> None:
    ops.rows("INSERT INTO {periodic} (name, last_tick, task) VALUES ('by.hand', now(), 'by.hand')")
    ops.rows("INSERT INTO {periodic} (name, last_tick) VALUES ('old.worker', now())")

    result = run_cli("cron", "run-now", "by.hand")

    job_id = int(result.out.split()[3])
    assert ops.rows(
        "SELECT task, queue, priority, max_attempts, args FROM {jobs} WHERE id = %s", (job_id,)
    ) == [("by.hand", "default", 0, 3, {})]
    undescribed = run_cli("cron", "run-now", "old.worker")
    assert (undescribed.code, undescribed.err) == (
        2,
        "skiplock: cron schedule 'old.worker' has no description yet: a worker that runs it "
        "writes one at its next pass\n",
    )


def test_an_unknown_schedule_is_named_with_where_to_look(ops: Ops, run_cli: Cli) -> None:
    for command in ("pause", "resume", "run-now"):
        result = run_cli("cron", command, "nightly")
        assert (result.code, result.err) == (
            2,
            "skiplock: no cron schedule 'nightly': `skiplock cron list` shows those workers "
            "have ticked\n",
        )


def test_the_admin_api(ops: Ops) -> None:
    enqueue_due_from(report_app(ops), FIRST_SEEN)
    app = skiplock.App(ops.url, schema=ops.schema)
    with app.connect(autocommit=True) as conn:
        admin = skiplock.Admin(app, conn)
        admin.pause_schedule("report")
        assert [s["paused"] for s in admin.schedules()] == [True]
        admin.resume_schedule("report")
        assert [s["paused"] for s in admin.schedules()] == [False]
        assert admin.run_schedule_now("report") > 0
