"""The monitoring figures: ``client.queue_stats`` and ``list_workers`` against rows written
in every state with chosen timestamps, ``skiplock status`` and its alert thresholds, and
the pure ``status_alerts``.

Ages are written relative to the database's ``now()`` and read back on the same clock;
the only slack allowed is the time the test itself takes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from skiplock import client
from skiplock.cli.status import status_alerts

from .conftest import Cli, Ops

SLACK = 30.0  # seconds the test may take between writing rows and reading figures


def stage(ops: Ops) -> None:
    """Queue "mail" in every state; "sms" only served by workers; "audit" only history."""
    ops.job(queue="mail", run_at=-30)
    ops.job(queue="mail", run_at=-10)
    ops.job(queue="mail", state="scheduled", run_at=3600)
    ops.job(queue="mail", state="scheduled", run_at=-45)  # due, not promoted yet
    ops.job(queue="mail", state="running", run_at=-300, attempted_at=-5)
    # Failed 20 s ago, due again since a minute ago (its place in line is its run_at).
    ops.job(
        queue="mail",
        state="retryable",
        run_at=-200,
        retry_at=-60,
        attempts=1,
        attempted_at=-20,
        errors=[ops.error(-20)],
    )
    ops.job(
        queue="mail",
        state="retryable",
        run_at=-200,
        retry_at=600,
        attempts=1,
        attempted_at=-120,
        errors=[ops.error(-120)],
    )
    for _ in range(2):
        ops.job(
            queue="mail",
            state="dead",
            run_at=-400,
            attempts=3,
            attempted_at=-120,
            errors=[ops.error(-300, attempt=1), ops.error(-200, attempt=2), ops.error(-120)],
        )
    ops.history(queue="mail", finished_at=-10, count=3)
    ops.history(queue="mail", finished_at=-300)  # more than a minute ago
    ops.history(queue="mail", finished_at=-10, state="cancelled")
    # Failed once half a minute ago, then completed: a completion and a failure.
    ops.history(queue="mail", finished_at=-20, attempts=2, errors=[ops.error(-30)])
    ops.history(queue="audit", finished_at=-15, count=2)
    ops.worker(queues=["mail", "sms"])
    ops.worker(queues=["mail", "sms"])
    ops.worker(queues=["sms"], concurrency=3)


def by_queue(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["queue"]: row for row in rows}


def test_queue_stats_figures(ops: Ops) -> None:
    stage(ops)

    with ops.connect() as conn:
        rows = client.queue_stats(conn, ops.schema)

    assert [row["queue"] for row in rows] == ["audit", "mail", "sms"]
    stats = by_queue(rows)
    mail = dict(stats["mail"])
    oldest = mail.pop("oldest_ready_seconds")
    assert mail == {
        "queue": "mail",
        "waiting": 0,
        "blocked": 0,
        "available": 2,
        "scheduled": 2,
        "running": 1,
        "retryable": 2,
        "dead": 2,
        "completed_last_minute": 4,
        "failed_last_minute": 2,
        "workers": 2,
    }
    # The retryable job came due 60 s ago: older than the due scheduled one (45 s) and
    # the oldest available one (30 s).
    assert 60.0 <= oldest < 60.0 + SLACK
    assert stats["sms"] == {
        "queue": "sms",
        "waiting": 0,
        "blocked": 0,
        "available": 0,
        "scheduled": 0,
        "running": 0,
        "retryable": 0,
        "dead": 0,
        "oldest_ready_seconds": None,
        "completed_last_minute": 0,
        "failed_last_minute": 0,
        "workers": 3,
    }
    assert stats["audit"]["completed_last_minute"] == 2
    assert stats["audit"]["workers"] == 0


def test_oldest_ready_age_ignores_jobs_not_yet_due(ops: Ops) -> None:
    ops.job(state="scheduled", run_at=600)
    ops.job(state="retryable", run_at=-600, retry_at=600, attempts=1)
    ops.job(state="running", run_at=-600)
    ops.job(state="dead", run_at=-600, attempts=3)

    with ops.connect() as conn:
        (row,) = client.queue_stats(conn, ops.schema)

    assert row["oldest_ready_seconds"] is None


def test_an_empty_schema_has_no_rows(ops: Ops) -> None:
    with ops.connect() as conn:
        assert client.queue_stats(conn, ops.schema) == []
        assert client.list_workers(conn, ops.schema) == []


def test_list_workers(ops: Ops) -> None:
    seen = ops.worker(queues=["a", "b"], concurrency=4)
    quiet = ops.worker(queues=["c"], last_seen=-300, holds_lock=False)
    ops.rows(
        "INSERT INTO {leader} (name, worker_id, expires_at) "
        "VALUES ('maintenance', %s, now() + interval '10 seconds')",
        (seen,),
    )

    with ops.connect() as conn:
        workers = {w["id"]: w for w in client.list_workers(conn, ops.schema)}

    assert set(workers) == {seen, quiet}
    assert workers[seen]["queues"] == ["a", "b"]
    assert workers[seen]["concurrency"] == 4
    assert workers[seen]["leader"] is True
    assert workers[seen]["holds_lock"] is True
    assert workers[seen]["last_seen_seconds"] < SLACK
    assert workers[quiet]["leader"] is False
    assert workers[quiet]["holds_lock"] is False
    assert 300 <= workers[quiet]["last_seen_seconds"] < 300 + SLACK


def test_an_expired_leader_row_is_no_leader(ops: Ops) -> None:
    worker = ops.worker()
    ops.rows(
        "INSERT INTO {leader} (name, worker_id, expires_at) "
        "VALUES ('maintenance', %s, now() - interval '1 second')",
        (worker,),
    )

    with ops.connect() as conn:
        (row,) = client.list_workers(conn, ops.schema)

    assert row["leader"] is False


# -- skiplock status -------------------------------------------------------------------

QUEUE_KEYS = {
    "queue",
    "waiting",
    "blocked",
    "available",
    "scheduled",
    "running",
    "retryable",
    "dead",
    "oldest_ready_seconds",
    "completed_last_minute",
    "failed_last_minute",
    "workers",
    "paused",
}
WORKER_KEYS = {
    "id",
    "host",
    "pid",
    "queues",
    "concurrency",
    "holds_lock",
    "started_at",
    "service_restarts",
    "last_seen_seconds",
    "leader",
}


def test_status_json_shape(ops: Ops, run_cli: Cli) -> None:
    stage(ops)

    result = run_cli("status", "--json")

    assert result.code == 0
    assert result.err == ""
    document = json.loads(result.out)
    assert set(document) == {
        "queues",
        "workers",
        "alerts",
        "notes",
        "waiting_for_signals",
        "signals_kept",
    }
    assert (document["waiting_for_signals"], document["signals_kept"]) == (0, 0)
    assert document["alerts"] == []
    assert [q["queue"] for q in document["queues"]] == ["audit", "mail", "sms"]
    assert all(set(q) == QUEUE_KEYS for q in document["queues"])
    assert by_queue(document["queues"])["mail"]["dead"] == 2
    assert len(document["workers"]) == 3
    assert all(set(w) == WORKER_KEYS for w in document["workers"])
    assert all(isinstance(w["id"], str) for w in document["workers"])


def test_status_max_dead_alerts_and_exits_1(ops: Ops, run_cli: Cli) -> None:
    stage(ops)

    result = run_cli("status", "--max-dead", "0")

    assert result.code == 1
    assert result.err.splitlines() == [
        "ALERT: queue mail: 2 dead jobs (more than 0); "
        "see `skiplock jobs list --state dead --queue mail`"
    ]
    assert "mail" in result.out
    assert run_cli("status", "--max-dead", "2").code == 0


def test_status_json_carries_the_alerts(ops: Ops, run_cli: Cli) -> None:
    stage(ops)

    result = run_cli(
        "status", "--json", "--max-dead", "0", "--min-workers", "4", "--max-available", "1"
    )

    assert result.code == 1
    assert json.loads(result.out)["alerts"] == [
        "queue mail: 2 dead jobs (more than 0); see `skiplock jobs list --state dead --queue mail`",
        "queue mail: 2 jobs ready (more than 1)",
        "3 workers registered (fewer than 4)",
    ]


def test_status_max_ready_age(ops: Ops, run_cli: Cli) -> None:
    ops.job(queue="slow", run_at=-120)

    alerting = run_cli("status", "--max-ready-age", "60")
    quiet = run_cli("status", "--max-ready-age", "3600")

    assert alerting.code == 1
    assert alerting.err.startswith("ALERT: queue slow: oldest ready job has waited 1")
    assert alerting.err.rstrip().endswith("s (more than 60s)")
    assert (quiet.code, quiet.err) == (0, "")


def test_status_table(ops: Ops, run_cli: Cli) -> None:
    stage(ops)

    result = run_cli("status")

    assert result.code == 0
    lines = result.out.splitlines()
    assert lines[0].split() == [
        "queue",
        "waiting",
        "blocked",
        "available",
        "scheduled",
        "running",
        "retryable",
        "dead",
        "oldest",
        "ready",
        "done/1m",
        "failed/1m",
        "workers",
    ]
    mail = next(line.split() for line in lines if line.startswith("mail"))
    assert mail[:8] == ["mail", "0", "0", "2", "2", "1", "2", "2"]
    assert mail[9:] == ["4", "2", "2"]
    assert "3 workers" in lines


def test_status_of_an_empty_schema(ops: Ops, run_cli: Cli) -> None:
    result = run_cli("status")

    assert result.code == 0
    assert "(no jobs and no workers)" in result.out
    assert "0 workers" in result.out.splitlines()


def test_status_of_a_schema_never_migrated(ops: Ops, run_cli: Cli) -> None:
    ops.rows(f'DROP SCHEMA "{ops.schema}" CASCADE')

    result = run_cli("status")

    assert result.code == 2
    assert "run `skiplock migrate` first" in result.err


# -- status_alerts: pure ---------------------------------------------------------------


def queue_row(name: str = "q", **figures: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(QUEUE_KEYS - {"queue", "oldest_ready_seconds"}, 0)
    row.update(queue=name, oldest_ready_seconds=None)
    row.update(figures)
    return row


def alerts(queues: list[dict[str, Any]], workers: int = 0, **limits: Any) -> list[str]:
    given: dict[str, Any] = dict.fromkeys(
        ("max_dead", "max_available", "max_ready_age", "min_workers")
    )
    given.update(limits)
    return status_alerts(queues, [{}] * workers, **given)


def test_no_thresholds_no_alerts() -> None:
    assert alerts([queue_row(dead=10**6, available=10**6, oldest_ready_seconds=1e9)]) == []


@pytest.mark.parametrize(
    ("limits", "figures", "expected"),
    [
        ({"max_dead": 3}, {"dead": 3}, []),
        (
            {"max_dead": 3},
            {"dead": 4},
            ["queue q: 4 dead jobs (more than 3); see `skiplock jobs list --state dead --queue q`"],
        ),
        ({"max_available": 10}, {"available": 10}, []),
        ({"max_available": 10}, {"available": 11}, ["queue q: 11 jobs ready (more than 10)"]),
        ({"max_ready_age": 30}, {"oldest_ready_seconds": 30.0}, []),
        ({"max_ready_age": 30}, {"oldest_ready_seconds": None}, []),
        (
            {"max_ready_age": 30},
            {"oldest_ready_seconds": 31.25},
            ["queue q: oldest ready job has waited 31.2s (more than 30s)"],
        ),
        (
            {"max_ready_age": 0.5},
            {"oldest_ready_seconds": 2.0},
            ["queue q: oldest ready job has waited 2.0s (more than 0.5s)"],
        ),
    ],
)
def test_queue_thresholds_are_exceeded_not_reached(
    limits: dict[str, Any], figures: dict[str, Any], expected: list[str]
) -> None:
    assert alerts([queue_row(**figures)], **limits) == expected


def test_min_workers() -> None:
    assert alerts([], workers=2, min_workers=2) == []
    assert alerts([], workers=1, min_workers=2) == ["1 worker registered (fewer than 2)"]


def test_every_queue_and_threshold_is_reported_in_order() -> None:
    queues = [queue_row("a", dead=1, available=5), queue_row("b", dead=2)]

    assert alerts(queues, workers=0, max_dead=0, max_available=4, min_workers=1) == [
        "queue a: 1 dead job (more than 0); see `skiplock jobs list --state dead --queue a`",
        "queue a: 5 jobs ready (more than 4)",
        "queue b: 2 dead jobs (more than 0); see `skiplock jobs list --state dead --queue b`",
        "0 workers registered (fewer than 1)",
    ]
