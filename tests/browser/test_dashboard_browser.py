"""The dashboard in a real browser: Debian's Chromium driven by Playwright.

The dashboard runs under uvicorn on a free port in a thread; workers are real
``skiplock.Worker``s. Playwright's own browser download is not used: the tests drive the
system Chromium (``apt-get install chromium``; scripts/test installs it when it can) and
skip, saying so, only when it is absent. Each page visited is saved as a screenshot under
artifacts/screenshots/ (see docs/dashboard.md).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from conftest import JobFactory, StartWorker, clean_tables, wait_until
from skiplock import client
from skiplock.dashboard import create_app
from skiplock.routing import describe_url
from test_routing import scratch_database

playwright_sync = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (it is in the dev extra)"
)
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed (the dashboard extra)")

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
    pytest.skip(
        f"no system Chromium at {CHROMIUM}: install it with `apt-get install chromium` "
        "(scripts/test does when run as root)",
        allow_module_level=True,
    )

SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
# Seconds Playwright waits for something to appear (the page polls every 0.3 s).
EXPECT_MS = 20_000

Page = Any  # playwright.sync_api.Page
# A name of another site that its DNS points at 127.0.0.1 (DNS rebinding); the browser
# fixture's resolver maps it so.
REBOUND = "rebound.example"


class DashboardServer:
    """uvicorn serving ``create_app`` on a free local port, in a thread."""

    def __init__(self, owner: skiplock.App, **options: Any) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        options.setdefault("refresh_seconds", 0.3)
        web = create_app(owner.database_url, owner.schema, **options)
        config = uvicorn.Config(web, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="dashboard", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DashboardServer:
        self.thread.start()
        wait_until(lambda: self.server.started, 20.0, "the dashboard to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20.0)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
            headless=True,
            # REBOUND resolves to this machine, as a rebinding site's name would.
            args=["--no-sandbox", f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"],
        )
        yield launched
        launched.close()


Serve = Callable[..., DashboardServer]


@pytest.fixture
def serve(app: skiplock.App) -> Iterator[Serve]:
    started: list[DashboardServer] = []

    def start(**options: Any) -> DashboardServer:
        started.append(DashboardServer(app, **options).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    opened = context.new_page()
    opened.set_default_timeout(EXPECT_MS)
    opened.on("dialog", lambda dialog: dialog.accept())
    yield opened
    context.close()


def screenshot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def expect(target: Any) -> Any:
    return playwright_sync.expect(target)


def finished_over_the_last_hour(app: skiplock.App) -> None:
    """History rows spread over the last hour, so the chart has something to show."""
    with app.connect() as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (id, queue, task, args, state, priority, attempts, "
                "max_attempts, errors, created_at, finished_at) "
                "SELECT 1000000 + g, 'emails', 'shop.send_receipt', '{{}}', 'completed', 0, "
                "1, 3, '[]', now() - m * interval '1 minute', now() - m * interval '1 minute' "
                "FROM generate_series(0, 59) AS m, "
                "LATERAL generate_series(1, 20 + (15 * sin(m / 6.0))::int) AS n, "
                "LATERAL (SELECT m * 100 + n AS g) AS ids"
            ).format(sql.Identifier(app.schema, "job_history"))
        )
        conn.commit()


def test_overview_shows_a_queues_counts(
    app: skiplock.App,
    make_job: JobFactory,
    serve: Serve,
    page: Page,
    start_worker: StartWorker,
) -> None:
    for _ in range(3):
        make_job(queue="emails", task="shop.send_receipt", args={"order_id": 1})
    make_job(queue="emails", state="dead", task="shop.send_receipt")
    later = datetime.now(UTC) + timedelta(hours=1)
    make_job(queue="reports", task="shop.nightly", state="scheduled", run_at=later)
    finished_over_the_last_hour(app)
    start_worker(app, queues=["reports"], concurrency=4)
    server = serve()

    page.goto(server.url + "/")

    row = page.locator('tr[data-queue="emails"]')
    expect(row.locator('[data-count="available"]')).to_have_text("3")
    expect(row.locator('[data-count="dead"]')).to_have_text("1")
    expect(page.locator('tr[data-queue="reports"] [data-count="scheduled"]')).to_have_text("1")
    # The hour's history: per queue, in the totals, and on a chart with both axes.
    hour = row.locator('[data-count="completed_hour"]').inner_text()
    assert int(hour) > 1000  # about 1,200 rows over the hour
    expect(page.locator('#queue-totals [data-total="completed_hour"]')).to_have_text(hour)
    expect(page.locator("#throughput .x-axis text")).to_have_count(6)
    expect(page.locator("#throughput .y-axis text").first).to_have_text("0")
    expect(page.locator("#throughput rect.completed")).to_have_count(60)
    # The live part refreshes by itself: a new job shows without a reload.
    make_job(queue="emails", task="shop.send_receipt")
    expect(row.locator('[data-count="available"]')).to_have_text("4")
    expect(page.locator("#workers")).to_contain_text("leader")
    screenshot(page, "overview")


def test_filtering_finds_a_job_by_an_argument(
    app: skiplock.App, make_job: JobFactory, serve: Serve, page: Page
) -> None:
    for n in range(20):
        make_job(task="shop.send_receipt", args={"order_id": 1000 + n})
    wanted = make_job(task="shop.refund", args={"order_id": 4242, "reason": "damaged"})
    server = serve()

    page.goto(server.url + "/jobs")
    page.fill('input[name="args"]', "4242")
    page.click('#filters button[type="submit"]')

    expect(page.locator("#jobs tbody tr")).to_have_count(1)
    expect(page.locator(f'tr[data-job="{wanted}"]')).to_contain_text("shop.refund")
    screenshot(page, "jobs-filtered")
    page.goto(server.url + "/jobs")
    screenshot(page, "jobs")


def test_jobs_are_found_by_tag_and_a_tag_on_a_job_lists_its_fellows(
    app: skiplock.App, serve: Serve, page: Page
) -> None:
    @app.task(name="shop.invoice", tags=["billing"])
    def invoice(order_id: int) -> None: ...

    with app.connect() as conn:
        for n in range(6):
            invoice.with_options(tags=["billing", "eu" if n % 2 else "us"]).enqueue(
                conn, order_id=2000 + n
            )
        untagged = int(invoice.with_options(tags=[]).enqueue(conn, order_id=1))
        conn.commit()
    server = serve()

    page.goto(server.url + "/jobs")
    page.fill('#filters input[name="tag"]', "eu")
    page.click('#filters button[type="submit"]')
    expect(page.locator("#jobs tbody tr")).to_have_count(3)
    expect(page.locator("#jobs tbody tr").first.locator("a.tag")).to_have_text(["billing", "eu"])
    screenshot(page, "jobs-by-tag")

    page.locator("#jobs tbody tr").first.locator("a.tag", has_text="billing").click()
    expect(page.locator('#filters input[name="tag"]')).to_have_value("billing")
    expect(page.locator("#jobs tbody tr")).to_have_count(6)
    expect(page.locator(f'tr[data-job="{untagged}"]')).to_have_count(0)


def test_a_dead_job_retried_from_its_page_completes(
    app: skiplock.App, make_job: JobFactory, serve: Serve, page: Page, start_worker: StartWorker
) -> None:
    @app.task(name="shop.charge")
    def charge(order_id: int) -> dict[str, int]:
        return {"charged": order_id}

    # A believable history for the README's screenshot: enqueued ten minutes ago, then
    # three attempts on two workers, each timed out after 20 s, the last one leaving the
    # job dead.
    now = datetime.now(UTC)
    workers = ["3f2a9c41-7d0e-4b8a-9a55-0c1d2e3f4a5b", "b81c07de-2f64-4e1a-8c3b-5d6e7f8091a2"]
    errors = [
        {
            "attempt": attempt,
            "worker": workers[attempt % 2],
            "claimed_at": (now - timedelta(minutes=10 - 3 * attempt, seconds=20)).isoformat(),
            "at": (now - timedelta(minutes=10 - 3 * attempt)).isoformat(),
            "type": "TimeoutError",
            "message": "the payment service did not answer",
            "traceback": 'Traceback (most recent call last):\n  File "/srv/shop/tasks.py", '
            "line 12, in charge\n    gateway.charge(order_id)\nTimeoutError: the payment "
            "service did not answer\n",
        }
        for attempt in (1, 2, 3)
    ]
    dead = make_job(
        task="shop.charge", args={"order_id": 77}, state="dead", attempts=3, errors=errors
    )
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {} SET created_at = %s, run_at = %s, started_at = %s, attempted_at = %s "
                "WHERE id = %s"
            ).format(sql.Identifier(app.schema, "jobs")),
            (
                now - timedelta(minutes=10),
                now - timedelta(minutes=10),
                datetime.fromisoformat(str(errors[0]["claimed_at"])),
                datetime.fromisoformat(str(errors[-1]["claimed_at"])),
                dead,
            ),
        )
    server = serve()

    page.goto(f"{server.url}/jobs/{dead}")
    expect(page.locator("#job-state")).to_have_text("dead")
    expect(page.locator(".timeline")).to_contain_text("attempt 2 claimed by worker 3f2a9c41")
    expect(page.locator("#job-ran")).to_have_text("20.0 s")  # the last attempt's
    expect(page.locator("#job-waited")).to_have_text("2.7 min")  # to the first claim
    screenshot(page, "job-dead")
    page.click("#retry")
    expect(page.locator(".notice")).to_contain_text(f"job {dead}: retry done")
    start_worker(app, poll_interval=0.05)

    expect(page.locator("#job-state")).to_have_text("completed")
    expect(page.locator("#result")).to_contain_text('"charged": 77')
    screenshot(page, "job")
    # The overview with the worker alive and the finished job in the chart.
    page.goto(server.url + "/")
    expect(page.locator("#workers tbody")).to_contain_text("default")
    expect(page.locator("figcaption")).to_contain_text("1 job in the hour")
    screenshot(page, "overview-worker")


def test_a_finished_job_runs_again_from_its_page(
    app: skiplock.App, serve: Serve, page: Page, start_worker: StartWorker
) -> None:
    @app.task(name="shop.receipt")
    def receipt(order_id: int) -> dict[str, int]:
        return {"sent": order_id}

    with app.connect() as conn:
        first = int(receipt.enqueue(conn, order_id=5))
        conn.commit()
    start_worker(app, poll_interval=0.05)
    server = serve()
    page.goto(f"{server.url}/jobs/{first}")
    expect(page.locator("#job-state")).to_have_text("completed")
    expect(page.locator("#retry")).to_have_count(0)

    page.click("#replay")  # the confirmation is accepted (the page fixture)

    notice = page.locator(".notice")
    expect(notice).to_contain_text(f"job {first} enqueued again as job ")
    copy = int(notice.inner_text().rsplit("job ", 1)[1].split()[0].rstrip("."))
    page.goto(f"{server.url}/jobs/{copy}")
    expect(page.locator("#job-state")).to_have_text("completed")
    expect(page.locator("#result")).to_contain_text('"sent": 5')
    screenshot(page, "job-run-again")


def test_a_scheduled_job_offers_run_now_and_deletes_look_destructive(
    make_job: JobFactory, serve: Serve, page: Page
) -> None:
    later = make_job(state="scheduled", run_at=datetime.now(UTC) + timedelta(hours=2))
    server = serve()
    page.goto(f"{server.url}/jobs/{later}")
    expect(page.locator("#job-state")).to_have_text("scheduled")
    expect(page.locator("#retry")).to_have_count(0)
    expect(page.locator("#delete")).to_have_class("danger")

    page.click("#run-now")

    expect(page.locator("#job-state")).to_have_text("available")
    page.goto(server.url + "/jobs")
    expect(page.locator("#delete-all")).to_have_class("danger")
    expect(page.locator("#retry-all")).not_to_have_class("danger")
    screenshot(page, "jobs-actions")


def test_a_cron_schedule_is_paused_and_run_now_without_the_app(
    app: skiplock.App, serve: Serve, page: Page
) -> None:
    with app.connect() as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (name, last_tick, expression, task, queue, priority, "
                "max_attempts, args, missed, next_tick) VALUES ('reports.nightly', now(), "
                "'0 3 * * *', 'reports.nightly', 'reports', 0, 3, '{{}}', 'latest', "
                "now() + interval '1 hour')"
            ).format(sql.Identifier(app.schema, "periodic"))
        )
        conn.commit()
    server = serve()
    page.goto(server.url + "/cron")
    row = page.locator('tr[data-schedule="reports.nightly"]')
    expect(row.locator(".state")).to_have_text("active")

    row.locator("button", has_text="Pause").click()

    expect(page.locator('tr[data-schedule="reports.nightly"] .state')).to_have_text("paused")
    screenshot(page, "cron-paused")
    page.locator('tr[data-schedule="reports.nightly"] button', has_text="Run now").click()
    expect(page.locator(".notice")).to_contain_text("schedule reports.nightly: job ")


def test_a_running_job_is_cancelled(
    app: skiplock.App, serve: Serve, page: Page, start_worker: StartWorker
) -> None:
    started = threading.Event()

    @app.task(name="shop.export")
    async def export() -> None:
        started.set()
        await asyncio.sleep(60)  # async handlers are cancelled outright

    with app.connect() as conn:
        job_id = int(export.enqueue(conn))
        conn.commit()
    start_worker(app, poll_interval=0.05)
    assert started.wait(15)
    server = serve()

    page.goto(f"{server.url}/jobs/{job_id}")
    expect(page.locator("#job-state")).to_have_text("running")
    page.click("#cancel")

    expect(page.locator("#job-state")).to_have_text("cancelled")


def test_a_queue_is_paused_and_resumed(
    app: skiplock.App, make_job: JobFactory, serve: Serve, page: Page
) -> None:
    make_job(queue="emails")
    server = serve()
    page.goto(server.url + "/")
    row = page.locator('tr[data-queue="emails"]')

    row.locator("button.queue-toggle").click()
    expect(row.locator(".queue-state")).to_have_text("paused")
    with app.connect() as conn:
        assert client.paused_queues(conn, app.schema) == ["emails"]
    screenshot(page, "overview-paused")

    page.locator('tr[data-queue="emails"] button.queue-toggle').click()
    expect(page.locator('tr[data-queue="emails"] .queue-state')).to_have_text("active")
    with app.connect() as conn:
        assert client.paused_queues(conn, app.schema) == []


def test_read_only_mode_hides_actions(
    app: skiplock.App, make_job: JobFactory, serve: Serve, page: Page
) -> None:
    dead = make_job(queue="emails", state="dead")
    server = serve(read_only=True)

    for path in ("/", "/jobs?state=dead", f"/jobs/{dead}"):
        page.goto(server.url + path)
        expect(page.locator("#read-only")).to_be_visible()
        expect(page.locator("main button")).to_have_count(1 if path.startswith("/jobs?") else 0)
        expect(page.locator("form[method=post]")).to_have_count(0)
    screenshot(page, "job-read-only")


def test_an_escaped_script_argument_does_not_execute(
    app: skiplock.App, make_job: JobFactory, serve: Serve, page: Page
) -> None:
    hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    job_id = make_job(task="shop.hostile", args={"note": hostile}, state="dead")
    server = serve()

    for path in ("/", "/jobs", f"/jobs/{job_id}", "/jobs?args=script"):
        page.goto(server.url + path)
        page.wait_for_load_state("load")
        assert page.evaluate("window.__pwned") is None, path
    expect(page.locator("#args")).to_have_count(0)  # the list page has no #args
    page.goto(f"{server.url}/jobs/{job_id}")
    expect(page.locator("#args")).to_contain_text("<script>window.__pwned = 1</script>")
    # Wait for a few refreshes (the fragment is swapped in by innerHTML) and check again.
    deadline = time.monotonic() + 5
    while page.evaluate("Number(document.getElementById('live').dataset.refreshed || 0)") < 2:
        assert time.monotonic() < deadline, "the page did not refresh"
        page.wait_for_timeout(100)
    assert page.evaluate("window.__pwned") is None


def test_a_page_of_another_site_rebound_to_this_machine_reads_nothing(
    app: skiplock.App, make_job: JobFactory, serve: Serve, page: Page
) -> None:
    """The browser reaches the dashboard through a name it does not serve: every page,
    and every request a script of that page makes to its own origin, is refused; through
    localhost the same dashboard works."""
    dead = make_job(task="shop.charge", state="dead", args={"card": "4111-secret"})
    server = serve()
    foreign = f"http://{REBOUND}:{server.port}"

    response = page.goto(f"{foreign}/jobs/{dead}")
    assert response is not None
    assert response.status == 403
    expect(page.locator("body")).to_contain_text(f"--allowed-host {REBOUND}")
    assert "4111-secret" not in page.content()
    # What the rebinding page's own script would do: read a job, then retry it.
    read = page.evaluate("path => fetch(path).then(r => r.text())", f"/jobs/{dead}")
    assert "4111-secret" not in read
    status = page.evaluate(
        "path => fetch(path, {method: 'POST'}).then(r => r.status)", f"/jobs/{dead}/retry"
    )
    assert status == 403
    screenshot(page, "rebound-refused")
    with psycopg.connect(app.database_url) as conn:
        assert client.get_job(conn, app.schema, dead).state == "dead"

    page.goto(f"http://localhost:{server.port}/jobs/{dead}")
    expect(page.locator("#args")).to_contain_text("4111-secret")


def test_a_click_held_across_a_refresh_still_follows_its_link(
    make_job: JobFactory, serve: Serve, page: Page
) -> None:
    """A refresh replaces the live part of the page; one that fell between a press and its
    release (a slow hand, a loaded machine) left the release on a new link, and the click
    went nowhere. The press is held over several refresh periods: the schedule of this
    test, not a wait for an outcome."""
    make_job(queue="emails")
    server = serve(refresh_seconds=0.2)
    page.goto(server.url + "/")
    page.locator('tr[data-queue="emails"] td a').first.hover()  # the pointer on the link
    page.mouse.down()
    page.wait_for_timeout(700)
    page.mouse.up()
    expect(page).to_have_url(re.compile(r"/jobs\?queue=emails"))


def test_cron_and_dead_pages(app: skiplock.App, make_job: JobFactory, page: Page) -> None:
    @app.periodic("*/15 * * * *", name="shop.nightly_report", queue="reports")
    def nightly_report() -> None: ...

    make_job(task="shop.charge", state="dead", args={"order_id": 5})
    server = DashboardServer(app, app=app).start()
    try:
        page.goto(server.url + "/cron")
        expect(page.locator("#cron")).to_contain_text("*/15 * * * *")
        screenshot(page, "cron")
        page.goto(server.url + "/jobs?state=dead")
        expect(page.locator("#retry-all")).to_be_visible()
        screenshot(page, "dead")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reports_url(server_url: str) -> Iterator[str]:
    """A second database on the test server, for an App whose queue "reports" lives there."""
    with scratch_database(server_url) as url:
        yield url


def test_a_job_on_the_second_database_is_found_and_retried_from_the_overview(
    app: skiplock.App, reports_url: str, page: Page
) -> None:
    clean_tables(reports_url)
    routed = skiplock.App(
        app.database_url, schema=app.schema, queue_databases={"reports": reports_url}
    )
    on_default = JobFactory(app.database_url)(queue="emails", task="shop.receipt", state="dead")
    JobFactory(app.database_url)(queue="emails", task="shop.receipt")
    on_reports = JobFactory(reports_url)(queue="reports", task="shop.monthly", state="dead")
    assert on_default == on_reports, "fresh tables: the same id on both databases"
    server = DashboardServer(routed, app=routed).start()
    try:
        page.goto(server.url + "/")
        heads = page.locator("#queues tr.database")
        expect(heads).to_have_text(
            [f"database {describe_url(app.database_url)}", f"database {describe_url(reports_url)}"]
        )
        reports_row = page.locator('tr[data-queue="reports"][data-db="1"]')
        emails_row = page.locator('tr[data-queue="emails"][data-db="0"]')
        expect(emails_row.locator('[data-count="available"]')).to_have_text("1")
        expect(reports_row.locator('[data-count="dead"]')).to_have_text("1")
        screenshot(page, "overview-two-databases")

        reports_row.locator('[data-count="dead"] a').click()
        expect(page.locator("#databases strong")).to_have_text(describe_url(reports_url))
        page.locator(f'tr[data-job="{on_reports}"] a').click()
        expect(page.locator("#job-database")).to_have_text(describe_url(reports_url))
        page.click("#retry")
        expect(page.locator(".notice")).to_contain_text(f"job {on_reports} on ")
        expect(page.locator("#job-state")).to_have_text("available")
    finally:
        server.stop()
    with psycopg.connect(app.database_url) as conn:
        assert client.get_job(conn, app.schema, on_default).state == "dead", "the other job"


def test_a_workflow_is_drawn_and_its_steps_turn_completed_as_they_run(
    app: skiplock.App, serve: Serve, page: Page, start_worker: StartWorker
) -> None:
    @app.task(name="report.step")
    def step() -> None:
        return None

    workflow = app.workflow("nightly-report")
    fetch = workflow.add(step.job(), name="fetch")
    parts = [workflow.add(step.job(), name=f"parse-{n}", after=[fetch]) for n in range(3)]
    workflow.add(step.job(), name="render", after=parts)
    with app.connect() as conn:
        ref = workflow.enqueue(conn)
        conn.commit()
    server = serve()

    page.goto(f"{server.url}/workflows/{ref.id}")
    graph = page.locator("#workflow-graph")
    expect(graph.locator("g.step")).to_have_count(5)
    expect(graph.locator("line.edge")).to_have_count(6)
    expect(graph.locator('g[data-step="render"]')).to_have_attribute("data-state", "waiting")
    screenshot(page, "workflow-waiting")
    start_worker(app, poll_interval=0.1)
    page.reload()
    expect(page.locator("#workflow-state")).to_have_text("completed")
    expect(graph.locator('g[data-state="completed"]')).to_have_count(5)
    screenshot(page, "workflow")
    page.locator('g[data-step="render"]').click()
    expect(page.locator("#job-state")).to_have_text("completed")
