"""The dashboard over a read URL and over several databases, against real databases.

- A read URL (``create_app(..., read_url=...)``, ``skiplock --read-url URL dashboard``)
  takes every page's reads and each page says how far behind it is; here it is the test
  database itself, a primary, so the pages say "not a replica". Actions go to the
  database URL only: with the other URL unreachable, each half still works alone. A real
  standby is tests/failover/test_dashboard_read_url.py.
- An App with ``queue_databases``: two databases on the test server (as in
  tests/test_routing.py), with the same job ids on both, which ``?db=N`` tells apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from starlette.applications import Starlette
from starlette.testclient import TestClient

import skiplock
from conftest import SCHEMA, JobFactory, clean_tables
from skiplock import client
from skiplock.cli import main
from skiplock.dashboard import create_app, web
from skiplock.dashboard.databases import dashboard_databases, pick_database
from skiplock.dashboard.reads import FilterError
from skiplock.errors import ConfigurationError
from skiplock.replica import READ_URL_ENV, ReplicaState
from skiplock.routing import describe_url
from test_dashboard import add_history, csrf
from test_routing import scratch_database

pytestmark = pytest.mark.timeout(120)

# Nothing listens on port 1: a connection there is refused at once.
NOWHERE = "postgresql://nobody:hunter2-nowhere@127.0.0.1:1/nowhere"
# The test server trusts local connections, so a password in the URL is never sent: it is
# only there to show that no page prints it.
PASSWORD = "hunter2-reports"
NOT_A_REPLICA = "the read URL is not a replica (not in recovery): reading current data"


def replica_line(html: str) -> str:
    found = re.search(r'<p class="replica[^"]*" id="replica" role="status">([^<]*)</p>', html)
    assert found, "the page does not say where it reads"
    return found[1]


def job_ids(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-job="(\d+)">', html)]


def state_on(url: str, job_id: int) -> str:
    with psycopg.connect(url) as conn:
        return str(client.get_job(conn, SCHEMA, job_id).state)


def retry(test_client: TestClient, path: str, **fields: str) -> Any:
    """A POST with the CSRF token of the sign-in page (which reads no database)."""
    data = {"csrf": csrf(test_client, "/login"), "next": "/", **fields}
    return test_client.post(path, data=data, follow_redirects=False)


# -- a read URL ------------------------------------------------------------------------


def test_a_replica_that_does_not_stream_says_so_and_as_of_when() -> None:
    """The words of the pages and of `status --read-url` (the real standby whose primary
    stopped is tests/failover/test_dashboard_read_url.py)."""
    last = datetime(2026, 12, 2, 1, 40, 5, tzinfo=UTC)
    gone = ReplicaState(True, 35.25, streaming=False, last_replay_at=last).describe()
    assert gone == (
        "reading from a replica that is not streaming from its primary (no WAL receiver): "
        "it shows its primary as of 2026-12-02 01:40:05Z, its last replayed commit, "
        "35.2 s ago, and falls further behind"
    )
    waiting = ReplicaState(
        True, 1.0, streaming=False, receiver_status="waiting", last_replay_at=last
    )
    assert "(its WAL receiver is waiting)" in waiting.describe()
    assert "replayed nothing yet" in ReplicaState(True, None, streaming=False).describe()
    assert ReplicaState(True, 0.0).describe() == "reading from a replica, 0.0 s behind its primary"


def test_every_page_reads_the_read_url_and_says_it_is_not_a_replica(
    app: skiplock.App, make_job: JobFactory
) -> None:
    dead = make_job(state="dead", queue="emails")
    done = add_history(app)
    # The database URL leads nowhere: a page that read it would fail.
    with TestClient(
        create_app(NOWHERE, SCHEMA, read_url=app.database_url), base_url="http://localhost"
    ) as web_client:
        for path in ("/", "/jobs", f"/jobs/{dead}", f"/jobs/{done}", "/cron", "/jobs?state=dead"):
            response = web_client.get(path)
            assert response.status_code == 200, (path, response.text)
            assert replica_line(response.text) == NOT_A_REPLICA, path
        # The live part carries it too: it is refreshed with the page.
        assert replica_line(web_client.get("/?fragment=1").text) == NOT_A_REPLICA
        assert job_ids(web_client.get("/jobs").text) == [done, dead]


def test_actions_go_to_the_database_url_never_the_read_url(
    app: skiplock.App, make_job: JobFactory
) -> None:
    dead, also_dead = make_job(state="dead", queue="emails"), make_job(state="dead")
    with TestClient(
        create_app(app.database_url, SCHEMA, read_url=NOWHERE), base_url="http://localhost"
    ) as web_client:
        response = retry(web_client, f"/jobs/{dead}/retry", next=f"/jobs/{dead}")
        assert response.status_code == 303
        assert response.headers["location"] == f"/jobs/{dead}"
        # "All matching" reads the matching ids on the primary, in the change's transaction.
        assert retry(web_client, "/bulk", action="retry:matching", state="dead").status_code == 303
        assert retry(web_client, "/queues/emails/pause").status_code == 303
    assert state_on(app.database_url, dead) == "available"
    assert state_on(app.database_url, also_dead) == "available"
    with app.connect() as conn:
        assert client.paused_queues(conn, SCHEMA) == ["emails"]


def test_the_page_after_an_action_says_the_replica_shows_it_once_replayed(
    app: skiplock.App, make_job: JobFactory
) -> None:
    dead = make_job(state="dead")
    with TestClient(
        create_app(app.database_url, SCHEMA, read_url=app.database_url), base_url="http://localhost"
    ) as web_client:
        page = retry(web_client, f"/jobs/{dead}/retry", next=f"/jobs/{dead}")
        after = web_client.get(page.headers["location"]).text
    notice = re.search(r'<p class="notice" role="status">([^<]*)</p>', after)
    assert notice, after
    assert notice[1] == f"job {dead}: retry done. {web.REPLICA_AFTER_CHANGE}"
    assert replica_line(after) == NOT_A_REPLICA


def test_without_a_read_url_pages_say_nothing_of_replicas(
    app: skiplock.App, make_job: JobFactory
) -> None:
    dead = make_job(state="dead")
    with TestClient(
        create_app(app.database_url, SCHEMA), base_url="http://localhost"
    ) as web_client:
        assert 'id="replica"' not in web_client.get("/").text
        page = retry(web_client, f"/jobs/{dead}/retry")
        assert "replica" not in web_client.get(page.headers["location"]).text


def test_the_read_connections_are_read_only(app: skiplock.App) -> None:
    """Even a read URL that is a primary is never written: its sessions are read-only."""
    dashboard_app = create_app(app.database_url, SCHEMA, read_url=app.database_url)
    dashboard: web.Dashboard = dashboard_app.state.dashboard
    (database,) = dashboard.databases
    try:
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            dashboard.read(database, lambda conn: conn.execute("CREATE TABLE written_here ()"))
        assert dashboard.change(database, lambda conn: conn.execute("SELECT 1").fetchone()) == (1,)
    finally:
        dashboard.close()


def test_an_unreachable_read_url_gives_an_error_page_that_names_it(
    app: skiplock.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web, "CONNECTION_WAIT_SECONDS", 1.0)
    with TestClient(
        create_app(app.database_url, SCHEMA, read_url=NOWHERE), base_url="http://localhost"
    ) as web_client:
        response = web_client.get("/jobs")
    assert response.status_code == 503
    message = re.search(r'<p class="notice bad" id="error">([^<]*)</p>', response.text)
    assert message, response.text
    assert message[1].startswith("cannot reach the read URL (the replica) 127.0.0.1:1/nowhere:")
    assert "refused" in message[1].lower()
    assert "hunter2" not in response.text and "Traceback" not in response.text


def test_the_command_reads_from_read_url_or_its_variable(
    app: skiplock.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    uvicorn = pytest.importorskip("uvicorn")
    served: list[Starlette] = []
    monkeypatch.setattr(uvicorn, "run", lambda web_app, **_options: served.append(web_app))
    monkeypatch.delenv(READ_URL_ENV, raising=False)

    assert main(["--database-url", NOWHERE, "--read-url", app.database_url, "dashboard"]) == 0
    monkeypatch.setenv(READ_URL_ENV, app.database_url)
    assert main(["--database-url", NOWHERE, "--schema", SCHEMA, "dashboard"]) == 0

    assert len(served) == 2
    for web_app in served:
        with TestClient(web_app, base_url="http://localhost") as web_client:
            assert replica_line(web_client.get("/").text) == NOT_A_REPLICA


# -- several databases -----------------------------------------------------------------


@pytest.fixture(scope="module")
def reports_url(server_url: str) -> Iterator[str]:
    """A second database on the test server, named with a password (never sent)."""
    with scratch_database(server_url) as url:
        yield make_conninfo(url, password=PASSWORD)


@pytest.fixture
def routed(database_url: str, reports_url: str) -> skiplock.App:
    """Queue "reports" on the second database, every other queue on the test database;
    clean tables on both, so that job ids start at 1 on each."""
    clean_tables(database_url)
    clean_tables(reports_url)
    return skiplock.App(database_url, schema=SCHEMA, queue_databases={"reports": reports_url})


@pytest.fixture
def web_over_both(routed: skiplock.App) -> Iterator[TestClient]:
    with TestClient(create_app(app=routed), base_url="http://localhost") as web_client:
        yield web_client


def heads(html: str) -> list[tuple[str, str]]:
    """(db, label) of each database's heading row, in page order."""
    head = r'<tr class="database" data-db="(\d+)"><th colspan="\d+">database ([^<]*)</th>'
    return [(str(db), str(where)) for db, where in re.findall(head, html)]


def row(html: str, queue: str, db: int) -> str:
    found = re.search(rf'<tr data-queue="{queue}" data-db="{db}">(.*?)</tr>', html, re.S)
    assert found, f"no row for queue {queue} of database {db}"
    return found[1]


def test_the_overview_shows_every_databases_queues_labelled(
    routed: skiplock.App, reports_url: str, web_over_both: TestClient
) -> None:
    default, reports = JobFactory(routed.database_url), JobFactory(reports_url)
    for _ in range(2):
        default(queue="emails")
    for _ in range(3):
        reports(queue="reports", state="dead")
    reports(queue="emails")  # a leftover from before the routes: shown where it is
    add_history(routed)
    add_history(skiplock.App(reports_url, schema=SCHEMA), queue="reports")

    html = web_over_both.get("/").text

    # Each database heads its queues, then its workers.
    both = [("0", describe_url(routed.database_url)), ("1", describe_url(reports_url))]
    assert heads(html) == both + both
    assert re.search(r'data-count="available">2<', row(html, "emails", 0))
    on_reports = row(html, "reports", 1)
    assert 'href="/jobs?db=1&amp;state=dead&amp;queue=reports">3</a>' in on_reports
    assert 'action="/queues/reports/pause?db=1"' in on_reports
    assert re.search(r'data-count="available">1<', row(html, "emails", 1))
    assert "2 jobs in the hour over 2 databases" in html
    assert '<span id="database-count">2 databases</span>' in html
    assert PASSWORD not in html
    assert 'id="replica"' not in html


def test_jobs_and_job_pages_reach_the_same_id_on_each_database(
    routed: skiplock.App, reports_url: str, web_over_both: TestClient
) -> None:
    on_default = JobFactory(routed.database_url)(task="shop.email", queue="emails")
    on_reports = JobFactory(reports_url)(task="shop.report", queue="reports", state="dead")
    assert on_default == on_reports, "fresh tables: both databases issue the same first id"

    listed = web_over_both.get("/jobs?db=1").text
    assert job_ids(listed) == [on_reports]
    assert f'href="/jobs/{on_reports}?db=1"' in listed
    assert '<input type="hidden" name="db" value="1">' in listed
    assert 'action="/bulk?db=1"' in listed
    assert PASSWORD not in listed
    # A queue's jobs are on its database, without saying which.
    assert "shop.report" in web_over_both.get("/jobs?queue=reports").text
    assert "shop.email" in web_over_both.get("/jobs").text

    job = web_over_both.get(f"/jobs/{on_reports}?db=1").text
    assert "shop.report" in job and "shop.email" not in job
    assert f'<dd id="job-database">{describe_url(reports_url)}</dd>' in job
    assert f'action="/jobs/{on_reports}/retry?db=1"' in job
    assert "shop.email" in web_over_both.get(f"/jobs/{on_default}?db=0").text

    missing = web_over_both.get("/jobs/4242?db=1")
    assert missing.status_code == 404
    assert "job ids are per database" in missing.text and "db=0" in missing.text
    wrong = web_over_both.get("/jobs?db=7")
    assert wrong.status_code == 400
    assert "db=&#39;7&#39; is not a database of this dashboard: use 0 (" in wrong.text


def test_actions_go_to_the_database_that_holds_the_job_or_queue(
    routed: skiplock.App, reports_url: str, web_over_both: TestClient
) -> None:
    on_default = JobFactory(routed.database_url)(queue="emails", state="dead")
    on_reports = JobFactory(reports_url)(queue="reports", state="dead")
    other = JobFactory(reports_url)(queue="reports", state="dead")

    response = retry(web_over_both, f"/jobs/{on_reports}/retry?db=1", next="/jobs?db=1")
    assert response.headers["location"] == "/jobs?db=1"
    assert state_on(reports_url, on_reports) == "available"
    assert state_on(routed.database_url, on_default) == "dead"

    retry(web_over_both, "/bulk?db=1", action="retry:matching", state="dead")
    assert state_on(reports_url, other) == "available"
    assert state_on(routed.database_url, on_default) == "dead"
    retry(web_over_both, "/bulk", action="retry", ids=str(on_default))
    assert state_on(routed.database_url, on_default) == "available"

    # A queue's action goes to its database (the overview's forms say db= as well).
    retry(web_over_both, "/queues/reports/pause")
    with psycopg.connect(reports_url) as conn:
        assert client.paused_queues(conn, SCHEMA) == ["reports"]
    with routed.connect() as conn:
        assert client.paused_queues(conn, SCHEMA) == []
    notice = web_over_both.get("/").text
    assert f"queue reports on {describe_url(reports_url)} paused" in notice


def test_the_cron_page_shows_each_databases_schedules(
    routed: skiplock.App, reports_url: str
) -> None:
    @routed.periodic("0 * * * *", name="shop.hourly_report", queue="reports")
    def hourly_report() -> None: ...

    @routed.periodic("*/5 * * * *", name="shop.digest", queue="emails")
    def digest() -> None: ...

    with TestClient(create_app(app=routed), base_url="http://localhost") as web_client:
        html = web_client.get("/cron").text
    assert heads(html) == [
        ("0", describe_url(routed.database_url)),
        ("1", describe_url(reports_url)),
    ]
    # Each schedule under its database's heading, its link naming the database.
    sections = html.split('<tr class="database"')[1:]
    assert 'href="/jobs?db=0&amp;task=shop.digest"' in sections[0]
    assert "hourly_report" not in sections[0]
    assert 'href="/jobs?db=1&amp;task=shop.hourly_report"' in sections[1]


def test_create_app_over_several_databases_is_checked(
    routed: skiplock.App, database_url: str, reports_url: str
) -> None:
    with pytest.raises(ConfigurationError, match="names one replica"):
        create_app(app=routed, read_url=database_url)
    with pytest.raises(ConfigurationError, match="is not the database_url of the App"):
        create_app(reports_url, app=routed)
    with pytest.raises(ConfigurationError, match="needs a database_url"):
        create_app()
    with pytest.raises(ConfigurationError, match="the read URL is malformed") as malformed:
        create_app(database_url, read_url="postgresql://u:sekrit@[host/x")
    assert "sekrit" not in str(malformed.value)
    # database_url is the App's own: the same dashboard as without it.
    both = dashboard_databases(database_url, read_url=None, app=routed)
    assert [(d.index, d.url) for d in both] == [(0, database_url), (1, reports_url)]


def test_the_command_serves_every_database_of_the_app_and_refuses_a_read_url(
    routed: skiplock.App,
    reports_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    uvicorn = pytest.importorskip("uvicorn")
    served: list[Starlette] = []
    monkeypatch.setattr(uvicorn, "run", lambda web_app, **_options: served.append(web_app))
    monkeypatch.setattr("skiplock.app.load_app", lambda _spec: routed)
    monkeypatch.delenv(READ_URL_ENV, raising=False)
    JobFactory(reports_url)(queue="reports")

    assert main(["dashboard", "--app", "myapp.tasks:app"]) == 0
    (web_app,) = served
    with TestClient(web_app, base_url="http://localhost") as web_client:
        assert re.search(r'data-count="available">1<', row(web_client.get("/").text, "reports", 1))

    code = main(["--read-url", routed.database_url, "dashboard", "--app", "myapp.tasks:app"])
    assert code == 2
    assert "names one replica" in capsys.readouterr().err
    assert len(served) == 1


# -- which database a request is about (pure) -------------------------------------------


def test_a_request_names_its_database_by_position_or_by_its_queue() -> None:
    routed = skiplock.App(
        "postgresql://app@main-db/app",
        queue_databases={"reports": "postgresql://app:pw@reports-db/reports"},
    )
    databases = dashboard_databases(None, read_url=None, app=routed)
    assert [d.label for d in databases] == ["main-db:5432/app", "reports-db:5432/reports"]
    assert pick_database(databases, {}).index == 0
    assert pick_database(databases, {"db": "1"}).index == 1
    assert pick_database(databases, {}, queue="reports", app=routed).index == 1
    assert pick_database(databases, {"db": "0"}, queue="reports", app=routed).index == 0
    assert pick_database(databases, {}, queue="emails", app=routed).index == 0
    for bad in ("2", "-1", "one"):
        with pytest.raises(FilterError, match="use 0 \\(main-db:5432/app\\), 1 \\(reports"):
            pick_database(databases, {"db": bad})
