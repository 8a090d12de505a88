"""Periodic (cron) tasks: checked when defined, each tick enqueued exactly once.

``enqueue_due`` takes ``now`` as an input, so the tests move the clock instead of
waiting for minutes to pass. Several "leaders" are several connections calling it at once
with the same ``now``: the compare-and-set on the periodic row lets exactly one of them
enqueue each tick.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import wait_until
from skiplock import ConfigurationError, EnqueueError
from skiplock.periodic import enqueue_due

from .conftest import Ops, StartWorker

pytestmark = pytest.mark.server_version

# Well in the past of the database's clock, so ticks are enqueued as available.
FIRST_SEEN = datetime(2025, 6, 1, 12, 0, 30, tzinfo=UTC)
EVERY_5_TICKS = [datetime(2025, 6, 1, 12, m, tzinfo=UTC) for m in (5, 10, 15, 20, 25, 30)]


def report_app(ops: Ops, cron: str = "*/5 * * * *", missed: str = "latest") -> skiplock.App:
    app = skiplock.App(ops.url, schema=ops.schema)

    @app.periodic(cron, args={"kind": "daily"}, missed=missed, name="report", queue="reports")
    def report(kind: str) -> None:
        return None

    return app


async def _enqueue(app: skiplock.App, now: datetime | None, name: str = "ops-periodic") -> int:
    async with await psycopg.AsyncConnection.connect(
        app.database_url, autocommit=True, application_name=name
    ) as conn:
        return await enqueue_due(conn, app, now)


def enqueue_due_from(app: skiplock.App, now: datetime | None, leaders: int = 1) -> list[int]:
    """``enqueue_due`` from ``leaders`` connections at once; jobs each enqueued."""

    async def race() -> list[int]:
        return list(await asyncio.gather(*(_enqueue(app, now) for _ in range(leaders))))

    return asyncio.run(race())


def enqueued(ops: Ops) -> list[tuple[Any, ...]]:
    return [
        tuple(row)
        for row in ops.rows("SELECT task, queue, args, state, run_at FROM {jobs} ORDER BY run_at")
    ]


def last_tick(ops: Ops, name: str = "report") -> datetime | None:
    rows = ops.rows("SELECT last_tick FROM {periodic} WHERE name = %s", (name,))
    return None if not rows else rows[0][0]


# -- definition time: no database needed -------------------------------------------------


@pytest.fixture
def app() -> skiplock.App:
    """An App that is never connected: definitions alone."""
    return skiplock.App("postgresql://nowhere.invalid/none", schema="ops_definitions")


def test_a_periodic_task_is_a_task_and_a_schedule(app: skiplock.App) -> None:
    @app.periodic("*/5 * * * *", args={"kind": "daily"}, name="report", queue="reports")
    def report(kind: str) -> None:
        return None

    entry = app.periodics["report"]
    assert app.tasks["report"] is entry.task
    assert entry.task.options.queue == "reports"
    assert entry.args == {"kind": "daily"}
    assert entry.missed == "latest"
    assert entry.schedule.expression == "*/5 * * * *"


def _define(app: skiplock.App, cron: str, **options: Any) -> None:
    @app.periodic(cron, **options)
    def tick(n: int = 0) -> None:
        return None


@pytest.mark.parametrize(
    ("cron", "options", "words"),
    [
        ("* * * *", {"name": "tick"}, "must have 5 fields"),
        ("0 0 30 2 *", {"name": "tick"}, "never fires"),
        ("61 * * * *", {"name": "tick"}, "minute: 61 is outside 0-59"),
        ("* * * * *", {"name": "tick", "timezone": "Nowhere/Atlantis"}, "unknown timezone"),
        ("* * * * *", {"name": "tick", "missed": "never"}, "choose one of latest, all, skip"),
        ("* * * * *", {"name": "tick", "queu": "x"}, "did you mean 'queue'"),
    ],
)
def test_bad_definitions_fail_at_once_and_register_nothing(
    app: skiplock.App, cron: str, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigurationError, match=words):
        _define(app, cron, **options)

    assert app.periodics == {}
    assert app.tasks == {}


def test_fixed_args_that_do_not_fit_the_handler_fail_at_definition(app: skiplock.App) -> None:
    with pytest.raises(EnqueueError, match="unexpected keyword argument 'm'"):
        _define(app, "* * * * *", name="tick", args={"m": 1})
    with pytest.raises(EnqueueError, match="report"):

        @app.periodic("* * * * *", name="report")
        def report(kind: str) -> None:  # a required argument that args= does not give
            return None

    assert app.periodics == {}


def test_a_definition_that_failed_on_its_args_can_be_fixed_and_repeated(
    app: skiplock.App,
) -> None:
    with pytest.raises(EnqueueError):
        _define(app, "* * * * *", name="tick", args={"m": 1})

    _define(app, "* * * * *", name="tick", args={"n": 1})

    assert "tick" in app.periodics


# -- ticks -----------------------------------------------------------------------------


def test_first_sight_records_now_and_enqueues_nothing(ops: Ops) -> None:
    app = report_app(ops)

    assert enqueue_due_from(app, FIRST_SEEN) == [0]

    assert enqueued(ops) == []
    assert last_tick(ops) == FIRST_SEEN


def test_first_sight_by_several_leaders_at_once(ops: Ops) -> None:
    app = report_app(ops)

    assert enqueue_due_from(app, FIRST_SEEN, leaders=5) == [0] * 5

    assert enqueued(ops) == []
    assert last_tick(ops) == FIRST_SEEN


def test_a_due_tick_is_enqueued_with_the_fixed_args_at_its_time(ops: Ops) -> None:
    app = report_app(ops)
    enqueue_due_from(app, FIRST_SEEN)

    assert enqueue_due_from(app, datetime(2025, 6, 1, 12, 5, 1, tzinfo=UTC)) == [1]

    tick = datetime(2025, 6, 1, 12, 5, tzinfo=UTC)
    assert enqueued(ops) == [("report", "reports", {"kind": "daily"}, "available", tick)]
    assert last_tick(ops) == tick
    # The same moment again, or a later one before the next tick: nothing new.
    assert enqueue_due_from(app, datetime(2025, 6, 1, 12, 9, 59, tzinfo=UTC)) == [0]
    assert len(enqueued(ops)) == 1


@pytest.mark.parametrize(
    ("missed", "now", "ticks"),
    [
        ("latest", datetime(2025, 6, 1, 12, 30, 40, tzinfo=UTC), EVERY_5_TICKS[-1:]),
        ("all", datetime(2025, 6, 1, 12, 30, 40, tzinfo=UTC), EVERY_5_TICKS),
        ("skip", datetime(2025, 6, 1, 12, 30, 40, tzinfo=UTC), EVERY_5_TICKS[-1:]),
        ("latest", datetime(2025, 6, 1, 12, 34, 0, tzinfo=UTC), EVERY_5_TICKS[-1:]),
        ("all", datetime(2025, 6, 1, 12, 34, 0, tzinfo=UTC), EVERY_5_TICKS),
        ("skip", datetime(2025, 6, 1, 12, 34, 0, tzinfo=UTC), []),
    ],
)
def test_missed_ticks_follow_the_policy(
    ops: Ops, missed: str, now: datetime, ticks: list[datetime]
) -> None:
    app = report_app(ops, missed=missed)
    enqueue_due_from(app, FIRST_SEEN)

    assert enqueue_due_from(app, now) == [len(ticks)]

    assert [row[4] for row in enqueued(ops)] == ticks
    assert last_tick(ops) == EVERY_5_TICKS[-1]  # skipped ticks are not offered again
    assert enqueue_due_from(app, now) == [0]


def _sessions_waiting_on_a_lock(conn: psycopg.Connection[Any], name: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = %s AND wait_event_type = 'Lock'",
        (name,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_leaders_that_read_the_same_last_tick_enqueue_each_tick_once(ops: Ops) -> None:
    """Every leader reads the same last tick; a transaction holding the periodic row
    makes them all reach the compare-and-set before any of them has committed."""
    app = report_app(ops, missed="all")
    enqueue_due_from(app, FIRST_SEEN)
    now = datetime(2025, 6, 1, 12, 30, 40, tzinfo=UTC)
    name = f"ops-race-{ops.schema}"
    leaders = 6

    with ops.connect() as watcher, ops.connect(autocommit=False) as holder:
        holder.execute(
            sql.SQL("SELECT 1 FROM {} WHERE name = 'report' FOR UPDATE").format(
                ops.table("periodic")
            )
        )
        results: list[int] = []

        def race() -> None:
            async def all_leaders() -> list[int]:
                return list(
                    await asyncio.gather(*(_enqueue(app, now, name) for _ in range(leaders)))
                )

            results.extend(asyncio.run(all_leaders()))

        racing = threading.Thread(target=race, daemon=True)
        racing.start()
        try:
            wait_until(
                lambda: _sessions_waiting_on_a_lock(watcher, name) == leaders,
                what="every leader to wait at the compare-and-set",
            )
        finally:
            holder.commit()
            racing.join(30)
    assert not racing.is_alive()

    assert sorted(results) == [0] * (leaders - 1) + [len(EVERY_5_TICKS)]
    assert [row[4] for row in enqueued(ops)] == EVERY_5_TICKS
    assert last_tick(ops) == EVERY_5_TICKS[-1]


def test_concurrent_leaders_over_many_ticks(ops: Ops) -> None:
    """Several leaders racing freely, round after round: every tick once, none missing."""
    app = report_app(ops, cron="* * * * *", missed="all")
    enqueue_due_from(app, FIRST_SEEN, leaders=4)
    now = FIRST_SEEN
    steps = (1, 3, 2, 7, 1)
    for step in steps:
        now += timedelta(minutes=step)

        assert sum(enqueue_due_from(app, now, leaders=4)) == step

    start = FIRST_SEEN.replace(second=0)
    expected = [start + timedelta(minutes=n) for n in range(1, sum(steps) + 1)]
    assert [row[4] for row in enqueued(ops)] == expected


def test_every_schedule_advances_on_its_own(ops: Ops) -> None:
    app = report_app(ops)

    @app.periodic("0 * * * *", name="hourly")
    def hourly() -> None:
        return None

    enqueue_due_from(app, FIRST_SEEN)
    assert enqueue_due_from(app, datetime(2025, 6, 1, 13, 0, 5, tzinfo=UTC)) == [2]

    assert sorted((row[0], row[4].minute) for row in enqueued(ops)) == [
        ("hourly", 0),
        ("report", 0),
    ]
    assert last_tick(ops, "hourly") == datetime(2025, 6, 1, 13, tzinfo=UTC)


def test_workers_of_one_app_enqueue_a_due_tick_once(ops: Ops, run_worker: StartWorker) -> None:
    """Two workers; the periodic row says a tick came due a minute ago (as after a
    restart). Both try to enqueue it, on the database's clock; one job runs it."""
    app = skiplock.App(ops.url, schema=ops.schema)
    ticks: list[datetime] = []

    @app.periodic("* * * * *", name="minutely", missed="latest")
    def minutely() -> None:
        ticks.append(skiplock.current_job().run_at)

    ops.rows(
        "INSERT INTO {periodic} (name, last_tick) "
        "VALUES ('minutely', date_trunc('minute', now()) - interval '2 minutes')"
    )
    run_worker(app)
    run_worker(app)

    wait_until(lambda: ops.count("history", "task = 'minutely'") >= 1, what="the tick to run")

    assert ticks, "the job ran"
    assert len(set(ticks)) == len(ticks)  # one job per tick, whichever worker ran it
    assert all(tick.second == 0 for tick in ticks)


# -- schedules of every App sharing the schema -------------------------------------------

# Yearly: the tick made due below is the only one a test can see, so exactly once means
# exactly one job.
YEARLY = "0 0 1 1 *"


def service_app(
    ops: Ops, service: str, runs: list[str], url: str | None = None, queue: str | None = None
) -> skiplock.App:
    """One service of several sharing the schema, with a schedule of its own on a queue
    of its own (a worker runs only the tasks its App knows)."""
    app = skiplock.App(url or ops.url, schema=ops.schema)

    @app.periodic(YEARLY, name=f"{service}.yearly", queue=queue or service)
    def yearly() -> None:
        runs.append(service)

    return app


def tick_due_now(ops: Ops, *names: str) -> None:
    """The schedules' rows say their last tick was the year before last (as after a long
    stop): this year's tick is due, once."""
    for name in names:
        ops.rows(
            "INSERT INTO {periodic} (name, last_tick) "
            "VALUES (%s, date_trunc('year', now()) - interval '1 year')",
            (name,),
        )


def jobs_of(ops: Ops, task: str) -> int:
    """Jobs of ``task``, live or finished, read in one statement: a job that moved to
    history between two reads (its handler has run, its outcome is written just after)
    would be counted twice."""
    return int(
        ops.scalar(
            "SELECT (SELECT count(*) FROM {jobs} WHERE task = %s) "
            "+ (SELECT count(*) FROM {history} WHERE task = %s)",
            (task, task),
        )
    )


def test_the_schedules_of_two_services_sharing_the_schema_both_tick_once(
    ops: Ops, run_worker: StartWorker
) -> None:
    """Two services, each with its own schedule and two workers, one database and
    schema: whichever worker leads, both schedules tick, each tick enqueued once."""
    runs: list[str] = []
    services = ("billing", "mailer")
    tick_due_now(ops, *(f"{service}.yearly" for service in services))
    for service in services:
        app = service_app(ops, service, runs)
        run_worker(app, queues=[service])
        run_worker(app, queues=[service])

    wait_until(
        lambda: set(runs) == set(services), timeout=20, what="both services' schedules to tick"
    )

    for service in services:
        assert jobs_of(ops, f"{service}.yearly") == 1
        assert runs.count(service) == 1
        assert last_tick(ops, f"{service}.yearly") == ops.scalar("SELECT date_trunc('year', now())")
