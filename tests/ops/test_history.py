"""History retention: daily partitions created ahead and dropped past retention, the
DEFAULT partition pruned in batches, and partition DDL that never waits behind a lock.

``history.plan`` is pure and tested as such. ``history.maintain`` takes ``now``, so a test
moves the clock a hundred days ahead instead of waiting; the DEFAULT partition's pruning
compares with the database's clock, so its rows are written days in the past.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql

from roles import login_roles
from skiplock import cli, grants, history
from skiplock.history import HistoryReport, partition_day, partition_name, plan
from skiplock.sql import history as history_sql

from .conftest import Cli, Ops

pytestmark = pytest.mark.server_version

DAY = timedelta(days=1)


def at(day: date, hour: int = 12) -> datetime:
    return datetime.combine(day, time(hour), tzinfo=UTC)


def names(*days: date) -> list[str]:
    return [partition_name(d) for d in days]


# -- plan: pure ------------------------------------------------------------------------


def test_partition_names_carry_their_day() -> None:
    assert partition_name(date(2026, 3, 9)) == "job_history_p20260309"
    assert partition_day("job_history_p20260309") == date(2026, 3, 9)
    assert partition_day("job_history_default") is None
    assert partition_day("job_history_p2026030") is None
    assert partition_day("job_history_p20261340") is None  # not a date
    assert partition_day("my_own_partition") is None


def test_plan_creates_today_and_three_days_ahead_that_are_missing() -> None:
    today = date(2026, 5, 10)
    existing = [*names(today, today + DAY), "job_history_default"]

    create, drop = plan(existing, at(today), retention=None)

    assert create == [today + 2 * DAY, today + 3 * DAY]
    assert drop == []


def test_plan_days_are_utc_days() -> None:
    # 01:00 in Berlin summer time is still the day before in UTC.
    berlin = timezone(timedelta(hours=2))
    create, _ = plan([], datetime(2026, 5, 10, 1, 0, tzinfo=berlin), None, days_ahead=0)

    assert create == [date(2026, 5, 9)]


def test_plan_drops_a_partition_once_its_whole_day_is_past_retention() -> None:
    existing = names(date(2026, 5, 1), date(2026, 5, 2), date(2026, 5, 3), date(2026, 5, 10))
    now = datetime(2026, 5, 10, 0, 0, tzinfo=UTC)

    _, drop = plan(existing, now, retention=timedelta(days=7))

    # The cutoff is 3 May 00:00: the 2nd ends exactly then, the 3rd holds newer rows.
    assert drop == names(date(2026, 5, 1), date(2026, 5, 2))


def test_plan_keeps_everything_without_retention_and_leaves_other_tables_alone() -> None:
    existing = [*names(date(2000, 1, 1)), "job_history_default", "job_history_archive"]

    _, drop = plan(existing, datetime(2026, 5, 10, tzinfo=UTC), retention=None)
    assert drop == []
    _, drop = plan(existing, datetime(2026, 5, 10, tzinfo=UTC), retention=timedelta(0))
    assert drop == names(date(2000, 1, 1))


def test_plan_with_fewer_days_ahead() -> None:
    create, _ = plan([], at(date(2026, 5, 10)), None, days_ahead=1)

    assert create == [date(2026, 5, 10), date(2026, 5, 11)]


# -- maintain: against the database -----------------------------------------------------


@pytest.fixture
def conn(ops: Ops) -> Iterator[psycopg.Connection[Any]]:
    with ops.connect() as connection:
        yield connection


def partitions(ops: Ops) -> list[str]:
    return [
        str(r[0])
        for r in ops.rows(
            history_sql.HISTORY_PARTITIONS, {"history": f'"{ops.schema}".job_history'}
        )
        if r[0] != "job_history_default"
    ]


def today(ops: Ops) -> date:
    value = ops.scalar("SELECT (now() AT TIME ZONE 'UTC')::date")
    assert isinstance(value, date)
    return value


def in_default(ops: Ops) -> int:
    """Rows in the DEFAULT partition."""
    with ops.connect() as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(ops.table("job_history_default"))
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_fresh_schema_has_today_and_three_days_ahead(ops: Ops) -> None:
    first = today(ops)

    assert partitions(ops) == names(*(first + n * DAY for n in range(4)))


def test_maintain_creates_ahead_and_drops_past_retention(
    ops: Ops, conn: psycopg.Connection[Any]
) -> None:
    from_migration = partitions(ops)
    base = today(ops) + 100 * DAY

    report = history.maintain(conn, ops.schema, retention=None, now=at(base))

    assert report == HistoryReport(created=names(base, base + DAY, base + 2 * DAY, base + 3 * DAY))
    expired = ops.history(finished_at=at(base, 6), count=2)
    expired += ops.history(finished_at=at(base + DAY, 23), state="cancelled")
    kept = ops.history(finished_at=at(base + 2 * DAY, 6))

    # Five days later with three days' retention: the cutoff is base + 2 days, noon.
    report = history.maintain(conn, ops.schema, retention=3 * DAY, now=at(base + 5 * DAY))

    assert sorted(report.dropped) == sorted([*from_migration, *names(base, base + DAY)])
    assert report.created == names(*(base + n * DAY for n in range(5, 9)))
    assert (report.skipped, report.pruned_rows) == ([], 0)
    assert partitions(ops) == names(*(base + n * DAY for n in (2, 3, 5, 6, 7, 8)))
    assert ops.count("history", "id = ANY(%s)", (expired,)) == 0
    assert ops.count("history", "id = ANY(%s)", (kept,)) == 1


def test_maintain_twice_changes_nothing_the_second_time(
    ops: Ops, conn: psycopg.Connection[Any]
) -> None:
    now = at(today(ops) + 10 * DAY)
    history.maintain(conn, ops.schema, retention=timedelta(days=7), now=now)

    assert history.maintain(conn, ops.schema, retention=timedelta(days=7), now=now) == (
        HistoryReport()
    )


def test_rows_in_default_are_pruned_in_batches_past_retention(
    ops: Ops, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No partition exists for these days, so the rows land in DEFAULT.
    old = ops.history(finished_at=-20 * 86400.0, count=5)
    recent = ops.history(finished_at=-5 * 86400.0, count=2)
    assert in_default(ops) == 7
    monkeypatch.setattr(history, "PRUNE_BATCH", 2)

    assert history.maintain(conn, ops.schema, retention=None).pruned_rows == 0
    report = history.maintain(conn, ops.schema, retention=timedelta(days=14))

    # Five rows at two per DELETE: the loop went round at least three times.
    assert report.pruned_rows == 5
    assert report.dropped == report.created == report.skipped == []
    assert ops.count("history", "id = ANY(%s)", (old,)) == 0
    assert ops.count("history", "id = ANY(%s)", (recent,)) == 2


def test_default_is_pruned_by_the_same_clock_as_partitions(
    ops: Ops, conn: psycopg.Connection[Any]
) -> None:
    ops.history(finished_at=-5 * 86400.0)  # in DEFAULT: no partition for that day
    now = ops.now() + timedelta(days=30)

    report = history.maintain(conn, ops.schema, retention=timedelta(days=14), now=now)

    assert report.pruned_rows == 1  # 35 days old by the clock maintain was given


def test_a_day_whose_rows_sit_in_default_gets_no_partition_and_no_error(
    ops: Ops, conn: psycopg.Connection[Any]
) -> None:
    day = today(ops) + 10 * DAY
    stray = ops.history(finished_at=at(day, 6))

    report = history.maintain(conn, ops.schema, retention=None, now=at(day))

    assert report.skipped == names(day)
    assert report.created == names(day + DAY, day + 2 * DAY, day + 3 * DAY)
    assert ops.count("history", "id = ANY(%s)", (stray,)) == 1
    assert in_default(ops) == 1


def test_partition_ddl_gives_up_while_another_session_holds_the_table(
    ops: Ops, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long transaction that only read job_history holds a lock that partition DDL
    must wait for; maintenance skips instead of queueing completions behind itself."""
    monkeypatch.setattr(history, "DDL_LOCK_TIMEOUT_MS", "200")
    ahead = today(ops) + 4 * DAY
    with ops.connect(autocommit=False) as reader:
        reader.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(ops.table("job_history"))
        )

        report = history.maintain(conn, ops.schema, retention=None, now=at(today(ops) + DAY))

        assert report == HistoryReport(skipped=names(ahead))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        reader.rollback()

    report = history.maintain(conn, ops.schema, retention=None, now=at(today(ops) + DAY))
    assert report == HistoryReport(created=names(ahead))


# -- as a role that owns nothing ------------------------------------------------------


@pytest.fixture
def worker_conn(ops: Ops) -> Iterator[psycopg.Connection[Any]]:
    """A connection as a login role with the worker's grants (``skiplock grant --worker``)
    and nothing else; the role is dropped afterwards."""
    with login_roles(ops.url) as roles:
        role, url = roles.create("worker")
        with ops.connect() as owner:
            for statement in grants.statements(ops.schema, role, grants.Use.WORKER):
                owner.execute(statement)
        with psycopg.connect(url, autocommit=True) as connection:
            yield connection


def test_a_worker_role_that_owns_nothing_creates_and_drops_partitions(
    ops: Ops, worker_conn: psycopg.Connection[Any]
) -> None:
    """Partition DDL needs the table's owner; maintenance calls the owner's functions."""
    base = today(ops) + 100 * DAY
    expired = ops.history(finished_at=at(today(ops)))

    created = history.maintain(worker_conn, ops.schema, retention=None, now=at(base))
    dropped = history.maintain(worker_conn, ops.schema, retention=timedelta(days=7), now=at(base))

    assert created.created == names(*(base + n * DAY for n in range(4)))
    assert dropped.dropped == names(*(today(ops) + n * DAY for n in range(4)))
    assert (created.skipped, dropped.skipped) == ([], [])
    assert partitions(ops) == names(*(base + n * DAY for n in range(4)))
    assert ops.count("history", "id = ANY(%s)", (expired,)) == 0
    owners = ops.rows(
        "SELECT DISTINCT pg_get_userbyid(c.relowner) = current_user FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
        (f'"{ops.schema}".job_history',),
    )
    assert owners == [(True,)]  # the schema's owner, not the worker's role


def test_a_worker_role_skips_a_locked_partition_as_the_owner_would(
    ops: Ops, worker_conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "DDL_LOCK_TIMEOUT_MS", "200")
    ahead = today(ops) + 4 * DAY
    with ops.connect(autocommit=False) as reader:
        reader.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(ops.table("job_history"))
        )

        report = history.maintain(worker_conn, ops.schema, retention=None, now=at(today(ops) + DAY))

        assert report == HistoryReport(skipped=names(ahead))
        reader.rollback()


def test_workflows_that_ended_before_the_retention_go_with_their_steps(
    ops: Ops, worker_conn: psycopg.Connection[Any]
) -> None:
    """Run by the worker's role, which may not delete from the workflow tables itself.
    Running workflows stay however old; ended ones stay until the retention has passed."""
    now = at(today(ops) + 30 * DAY)
    made = {}
    for label, state, ended_days_ago in (
        ("old", "completed", 20),
        ("old failed", "failed", 15),
        ("recent", "completed", 2),
        ("running", "running", None),
    ):
        finished = None if ended_days_ago is None else now - timedelta(days=ended_days_ago)
        row = ops.rows(
            "INSERT INTO {workflows} (name, state, steps, steps_left, created_at, finished_at) "
            "VALUES (%s, %s, 2, %s, %s, %s) RETURNING id",
            (label, state, 2 if finished is None else 0, now - timedelta(days=40), finished),
        )
        made[label] = row[0][0]
        ops.rows(
            "INSERT INTO {workflow_steps} (job_id, workflow_id, step, name) "
            "SELECT %s * 10 + n, %s, n, 's' || n FROM generate_series(1, 2) AS n",
            (made[label], made[label]),
        )

    report = history.maintain(worker_conn, ops.schema, retention=timedelta(days=7), now=now)

    assert report.pruned_workflows == 2
    left = ops.rows("SELECT name FROM {workflows} ORDER BY id")
    assert [r[0] for r in left] == ["recent", "running"]
    steps = ops.rows("SELECT DISTINCT workflow_id FROM {workflow_steps} ORDER BY 1")
    assert [r[0] for r in steps] == [made["recent"], made["running"]]


def test_the_steps_of_jobs_that_ended_before_the_retention_go(
    ops: Ops, worker_conn: psycopg.Connection[Any]
) -> None:
    """Durable steps (skiplock.step) stay while their job is live, however old, and for
    the retention after they were recorded once it has ended. Run by the worker's role."""
    now = at(today(ops) + 30 * DAY)
    live = ops.rows("INSERT INTO {jobs} (task, args) VALUES ('t', '{{}}') RETURNING id")[0][0]
    for job_id, days_ago in ((live, 20), (live + 1000, 20), (live + 2000, 2)):
        ops.rows(
            "INSERT INTO {job_steps} (job_id, name, attempt, result, done_at) "
            "VALUES (%s, 'charge', 1, '1', %s)",
            (job_id, now - timedelta(days=days_ago)),
        )

    report = history.maintain(worker_conn, ops.schema, retention=timedelta(days=7), now=now)

    assert report.pruned_steps == 1
    left = ops.rows("SELECT job_id FROM {job_steps} ORDER BY job_id")
    assert [r[0] for r in left] == [live, live + 2000]


# -- skiplock prune --------------------------------------------------------------------


def test_prune_creates_a_missing_partition(ops: Ops, run_cli: Cli) -> None:
    tomorrow = partition_name(today(ops) + DAY)
    ops.rows(f'DROP TABLE "{ops.schema}".{tomorrow}')

    result = run_cli("prune", "--keep-forever")

    assert result.code == 0
    assert result.out.strip() == (
        f"history partitions created: {tomorrow}; dropped: none; "
        "rows pruned from the default partition: 0; ended workflows pruned: 0; "
        "steps of ended jobs pruned: 0; expired signals deleted: 0"
    )
    assert tomorrow in partitions(ops)


def test_prune_with_retention_days_prunes_default(ops: Ops, run_cli: Cli) -> None:
    ops.history(finished_at=-20 * 86400.0, count=3)
    ops.history(finished_at=-5 * 86400.0)

    result = run_cli("prune", "--retention-days", "14")

    assert result.code == 0
    assert result.out.strip().endswith(
        "rows pruned from the default partition: 3; ended workflows pruned: 0; "
        "steps of ended jobs pruned: 0; expired signals deleted: 0"
    )
    assert in_default(ops) == 1


class _Started(Exception):  # noqa: N818 - a signal for the test, not an error
    """Raised instead of starting a process; carries nothing."""


def test_worker_processes_keep_the_history_retention_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[list[str]] = []

    def popen(command: list[str], *args: Any, **kwargs: Any) -> None:
        started.append(command)
        raise _Started

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(_Started):
        cli.main(
            [
                "--database-url",
                "postgresql://nowhere.invalid/none",
                "worker",
                "myapp.tasks:app",
                "--processes",
                "2",
                "--history-retention-days",
                "30",
            ]
        )

    (command,) = started
    assert command[command.index("--history-retention-days") + 1] == "30"
