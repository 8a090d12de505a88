"""The dashboard on a real streaming standby: ``create_app(primary, read_url=standby)``.

The standby's replay is paused (``pg_wal_replay_pause()``) to make it fall behind on
purpose: the pages then show what the standby has, not what the primary has, and say how
far behind it is; a retry posted meanwhile is made on the primary at once, and shows on
the pages once replay resumes. The CLI's counterpart is test_read_url.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC
from functools import partial

import psycopg
import pytest
from starlette.testclient import TestClient

from chaos.conftest import SCHEMA
from conftest import JobFactory, wait_until
from skiplock import client
from skiplock.bench.topology import Topology
from skiplock.cli import main
from skiplock.dashboard import create_app, security
from skiplock.dashboard.web import REPLICA_AFTER_CHANGE

REPLICA = re.compile(r'<p class="replica standby" id="replica" role="status">([^<]*)</p>')
ANY_REPLICA = re.compile(r'<p class="replica[^"]*" id="replica" role="status">([^<]*)</p>')
BEHIND = re.compile(r"reading from a replica, (\d+\.\d) s behind its primary")


def lag_said(html: str) -> float:
    """The lag a page says, in seconds; fails if it does not say one."""
    line = REPLICA.search(html)
    assert line, "the page does not say it reads a replica"
    behind = BEHIND.fullmatch(line[1])
    assert behind, line[1]
    return float(behind[1])


def says_no_lag(web: TestClient, path: str) -> bool:
    return lag_said(web.get(path).text) == 0.0


def job_ids(html: str) -> set[int]:
    return {int(i) for i in re.findall(r'<tr data-job="(\d+)">', html)}


def job_state(html: str) -> str:
    found = re.search(r'id="job-state">(\w+)<', html)
    assert found, html
    return found[1]


def on_standby(standby: str, job_id: int) -> bool:
    with psycopg.connect(standby, autocommit=True) as conn:
        row = conn.execute(f"SELECT 1 FROM {SCHEMA}.jobs WHERE id = %s", (job_id,)).fetchone()
    return row is not None


def replay(standby: str, *, paused: bool) -> None:
    with psycopg.connect(standby, autocommit=True) as conn:
        conn.execute("SELECT pg_wal_replay_pause()" if paused else "SELECT pg_wal_replay_resume()")


@pytest.mark.timeout(180)
def test_the_dashboard_reads_the_standby_says_its_lag_and_acts_on_the_primary(
    build_cluster: Callable[[bool], Topology],
) -> None:
    cluster = build_cluster(False)
    primary, standby = cluster.primary.local_url(), cluster.standby.local_url()
    make_job = JobFactory(primary, SCHEMA)
    dead = make_job(queue="emails", task="shop.charge", state="dead", attempts=3)
    wait_until(lambda: on_standby(standby, dead), 30, interval=0.05, what="the standby to replay")

    web = TestClient(
        create_app(primary, SCHEMA, read_url=standby, refresh_seconds=0.3),
        base_url="http://localhost",
    )
    with web:
        # Caught up: every page reads the standby and says it is 0 s behind (waited for:
        # WAL the idle primary writes by itself may be in flight for a moment).
        for path in ("/", "/jobs", f"/jobs/{dead}", "/cron"):
            wait_until(
                partial(says_no_lag, web, path),
                30,
                interval=0.1,
                what=f"{path} to say it is not behind",
            )
        assert re.search(r'data-count="dead">(?:<a[^>]*>)?1<', web.get("/").text)

        # Replay paused: a job enqueued on the primary is not on the standby's pages,
        # and the lag they say grows (the standby has received WAL it has not replayed).
        replay(standby, paused=True)
        later = make_job(queue="emails", task="shop.later")
        assert job_ids(web.get("/jobs").text) == {dead}
        wait_until(
            lambda: lag_said(web.get("/?fragment=1").text) >= 0.5,
            30,
            interval=0.1,
            what="the live part to say the standby is behind",
        )

        # A retry goes to the primary at once; the page after it, read on the standby,
        # still shows the job dead, and says why.
        response = web.post(
            f"/jobs/{dead}/retry",
            data={"csrf": web.cookies[security.CSRF_COOKIE], "next": f"/jobs/{dead}"},
            follow_redirects=False,
        )
        assert response.status_code == 303
        with psycopg.connect(primary) as conn:
            assert client.get_job(conn, SCHEMA, dead).state == "available"
        after = web.get(f"/jobs/{dead}").text
        assert job_state(after) == "dead"
        assert f"job {dead}: retry done. {REPLICA_AFTER_CHANGE}" in after
        assert lag_said(after) > 0.0

        # Replay resumed: the pages catch up with the primary.
        replay(standby, paused=False)
        wait_until(
            lambda: job_state(web.get(f"/jobs/{dead}?fragment=1").text) == "available",
            30,
            interval=0.1,
            what="the standby's page to show the retry",
        )
        assert job_ids(web.get("/jobs").text) == {dead, later}
        wait_until(partial(says_no_lag, web, "/"), 30, interval=0.1, what="the lag to be 0 again")


def replica_line(html: str) -> str:
    line = ANY_REPLICA.search(html)
    assert line, "the page does not say it reads a replica"
    return line[1]


def has_no_receiver(standby: str) -> bool:
    with psycopg.connect(standby, autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_stat_wal_receiver").fetchone() is None


@pytest.mark.timeout(180)
def test_a_standby_that_stopped_streaming_is_said_so_and_since_when(
    build_cluster: Callable[[bool], Topology],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The primary stops: the standby's WAL receiver is gone, it has replayed all it
    received, and its data ages from its last replayed commit on. The pages and `status
    --read-url` say it is not streaming and as of when it shows its primary, not that it
    is 0 s behind."""
    cluster = build_cluster(False)
    primary, standby = cluster.primary.local_url(), cluster.standby.local_url()
    job = JobFactory(primary, SCHEMA)(queue="emails", task="shop.charge")
    wait_until(lambda: on_standby(standby, job), 30, interval=0.05, what="the standby to replay")

    with TestClient(
        create_app(primary, SCHEMA, read_url=standby), base_url="http://localhost"
    ) as web:
        wait_until(
            partial(says_no_lag, web, "/"), 30, interval=0.1, what="the page to say 0 s behind"
        )
        cluster.primary.stop()
        wait_until(
            partial(has_no_receiver, standby), 60, interval=0.1, what="the WAL receiver to go"
        )
        with psycopg.connect(standby, autocommit=True) as conn:
            row = conn.execute("SELECT pg_last_xact_replay_timestamp()").fetchone()
        assert row is not None and row[0] is not None
        since = row[0].astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")

        for path in ("/", "/jobs", f"/jobs/{job}", "/cron", "/?fragment=1"):
            response = web.get(path)
            assert response.status_code == 200, path
            line = replica_line(response.text)
            assert "not streaming" in line and since in line, (path, line)
            assert "0.0 s behind" not in line, (path, line)
        assert job_ids(web.get("/jobs").text) == {job}, "the standby's jobs still show"

    assert (
        main(["--database-url", primary, "--read-url", standby, "--schema", SCHEMA, "status"]) == 0
    )
    said = capsys.readouterr().err
    assert "not streaming" in said and since in said, said
