"""``--read-url`` / ``SKIPLOCK_READ_URL``: ``skiplock status`` and ``jobs list`` read from a
replica and say how far behind it is (skiplock/replica.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from chaos.chaos_app import app as chaos_app
from chaos.chaos_app import work_async
from chaos.conftest import SCHEMA
from conftest import wait_until
from skiplock.bench.topology import Topology
from skiplock.cli import main
from skiplock.replica import READ_URL_ENV, ReplicaState


def test_the_lag_is_said_in_seconds_or_as_unknown() -> None:
    assert ReplicaState(True, 2.345).describe().endswith("2.3 s behind its primary")
    assert "lag is unknown" in ReplicaState(True, None).describe()
    assert "not a replica" in ReplicaState(False, None).describe()


def test_a_read_url_that_is_a_primary_says_so(
    database_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(READ_URL_ENV, database_url)
    assert main(["--database-url", "postgresql://nobody@invalid.invalid/x", "status"]) == 0
    assert "the read URL is not a replica" in capsys.readouterr().err


def test_writes_never_go_to_the_read_url(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            *("--database-url", database_url, "--read-url", "postgresql://x@invalid.invalid/x"),
            *("jobs", "retry", "--all", "--state", "dead", "--yes"),
        ]
    )
    assert code == 0, capsys.readouterr()
    assert "replica" not in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_status_and_jobs_list_read_from_the_standby_and_say_its_lag(
    build_cluster: Callable[[bool], Topology],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = build_cluster(True)
    monkeypatch.delenv(READ_URL_ENV, raising=False)
    primary, standby = cluster.primary.local_url(), cluster.standby.local_url()
    with psycopg.connect(primary, autocommit=True) as conn, conn.transaction():
        (job_id,) = chaos_app.enqueue_many(conn, [work_async.job(ms=1)])

    def replayed() -> Any:
        with psycopg.connect(standby, autocommit=True) as conn:
            return conn.execute(f"SELECT 1 FROM {SCHEMA}.jobs WHERE id = %s", (job_id,)).fetchone()

    wait_until(replayed, 30, interval=0.05, what="the standby to replay the enqueue")
    base = ["--database-url", primary, "--read-url", standby, "--schema", SCHEMA]
    assert main([*base, "jobs", "list", "--json"]) == 0
    out, err = capsys.readouterr()
    assert f'"id": {job_id}' in out
    assert "reading from a replica" in err and "s behind its primary" in err
    assert main([*base, "status", "--json"]) == 0
    out, err = capsys.readouterr()
    assert '"chaos"' in out and "reading from a replica" in err
