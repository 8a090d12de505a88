"""The web dashboard through its HTTP interface, against the real database.

Pages are read as a browser would get them (Starlette's TestClient); actions are posted
with the CSRF token the pages hand out, and their effect is checked in the tables.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import psycopg
import pytest
from markupsafe import escape
from psycopg import sql
from psycopg.pq import Format
from psycopg.types.json import Jsonb
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

import skiplock
from conftest import JobFactory, StartWorker, wait_until
from skiplock import client
from skiplock.cli import main
from skiplock.dashboard import create_app, reads, security, values
from skiplock.errors import ConfigurationError

SCHEMA = "skiplock"
# The name the tests reach the dashboard by (TestClient's own, "testserver", is refused).
LOCAL = "http://localhost"


@pytest.fixture
def web(app: skiplock.App) -> Iterator[TestClient]:
    with TestClient(
        create_app(app.database_url, app.schema), base_url="http://localhost"
    ) as test_client:
        yield test_client


def csrf(test_client: TestClient, page: str = "/") -> str:
    """The CSRF token a page hands out (the cookie; the form field carries the same)."""
    test_client.get(page)
    token = test_client.cookies.get(security.CSRF_COOKIE)
    assert token
    return str(token)


def post(test_client: TestClient, path: str, **fields: Any) -> Any:
    data = {"csrf": csrf(test_client), "next": "/", **fields}
    return test_client.post(path, data=data)


def add_history(
    app: skiplock.App,
    *,
    task: str = "noop",
    queue: str = "default",
    state: str = "completed",
    args: dict[str, Any] | None = None,
    result: Any = None,
    errors: list[dict[str, Any]] | None = None,
    finished_at: datetime | None = None,
) -> int:
    """A finished job, as a worker leaves it in job_history."""
    with psycopg.connect(app.database_url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "INSERT INTO {history} (id, queue, task, args, state, priority, attempts, "
                "max_attempts, errors, result, created_at, attempted_at, finished_at) "
                "VALUES (nextval(pg_get_serial_sequence(%s, 'id')), %s, %s, %s, %s, 0, 1, 3, "
                "%s, %s, now(), now(), coalesce(%s, now())) RETURNING id"
            ).format(history=sql.Identifier(app.schema, "job_history")),
            (
                f"{app.schema}.jobs",
                queue,
                task,
                Jsonb(args or {}),
                state,
                Jsonb(errors or []),
                Jsonb(result),
                finished_at,
            ),
        ).fetchone()
    assert row is not None
    return int(row[0])


def job_state(app: skiplock.App, job_id: int) -> str:
    with app.connect() as conn:
        return str(client.get_job(conn, app.schema, job_id).state)


def cells(html: str, queue: str) -> dict[str, str]:
    """The counts of one queue's row on the overview."""
    row = re.search(rf'<tr data-queue="{re.escape(queue)}">(.*?)</tr>', html, re.S)
    assert row, f"no row for queue {queue}"
    found = re.findall(r'data-count="(\w+)">(?:<(?:a|span)[^>]*>)?(\d+)', row[1])
    return dict(found)


ERROR: dict[str, Any] = {
    "attempt": 1,
    "at": "2026-12-01T10:00:00+00:00",
    "type": "PaymentDeclined",
    "message": "card refused",
    "traceback": (
        "Traceback (most recent call last):\n"
        '  File "/venv/lib/python3.11/site-packages/skiplock/executor.py", line 200, in run\n'
        "    result = handler(**args)\n"
        '  File "/srv/shop/tasks.py", line 12, in charge\n'
        "    raise PaymentDeclined('card refused')\n"
        "PaymentDeclined: card refused\n"
    ),
}


# -- pages ----------------------------------------------------------------------------


def test_overview_counts_each_state_per_queue(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    for state, count in (("available", 3), ("scheduled", 1), ("retryable", 2), ("dead", 4)):
        for _ in range(count):
            make_job(queue="emails", state=state, run_at=datetime.now(UTC) - timedelta(minutes=5))
    make_job(queue="reports")
    with app.connect() as conn:
        conn.execute(
            f"UPDATE {SCHEMA}.jobs SET state = 'blocked', ordering_key = 'k' "
            "WHERE id = (SELECT max(id) FROM skiplock.jobs WHERE queue = 'reports')"
        )
        client.set_queue_paused(conn, app.schema, "emails", paused=True)
        client.set_queue_limits(conn, app.schema, "emails", concurrency=5, rate="100/s")
        conn.commit()

    html = web.get("/").text

    assert cells(html, "emails") == {
        "available": "3",
        "scheduled": "1",
        "running": "0",
        "retryable": "2",
        "blocked": "0",
        "waiting": "0",
        "dead": "4",
        "completed_hour": "0",
        "failed_hour": "0",
    }
    assert cells(html, "reports")["blocked"] == "1"
    emails = re.search(r'<tr data-queue="emails">(.*?)</tr>', html, re.S)
    assert emails
    assert "paused" in emails[1]
    assert "≤ 5 running" in emails[1]
    assert "≤ 100 per 1 s" in emails[1]
    assert re.search(r"5\.\d min", emails[1]), "the oldest ready age"


def test_overview_shows_workers_and_throughput(
    app: skiplock.App, web: TestClient, start_worker: StartWorker
) -> None:
    for _ in range(7):
        add_history(app)
    add_history(app, state="cancelled")
    start_worker(app, queues=["default", "emails"], concurrency=3)

    html = web.get("/").text

    workers = re.search(r'<table class="grid" id="workers">(.*?)</table>', html, re.S)
    assert workers
    assert "default, emails" in workers[1]
    assert re.search(r'<td class="num">3</td><td class="num">0</td>', workers[1])
    assert "8 jobs in the hour; busiest minute 8" in html
    assert "completed 7 · " in html and "cancelled 1 · " in html
    chart = re.search(r'<figure class="chart" id="throughput">(.*?)</figure>', html, re.S)
    assert chart
    assert chart[1].count('<g class="bar">') == 60
    # One minute held all eight: one stack of a completed and a cancelled part.
    assert chart[1].count('<rect class="completed"') == 1
    assert chart[1].count('<rect class="cancelled"') == 1
    # A count axis up to a round number at or above the peak, and a time axis.
    y_labels = re.findall(r'<text x="37"[^>]*>(\d+)</text>', chart[1])
    assert y_labels == ["0", "2", "4", "6", "8"]
    x_labels = re.findall(r'text-anchor="middle">(\d\d:\d0)</text>', chart[1])
    assert len(x_labels) == 6 and sorted(set(x_labels)) == sorted(x_labels)
    assert "jobs / min" in chart[1]


def test_overview_counts_each_queue_s_last_hour_and_totals(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    add_history(app, queue="emails")
    add_history(app, queue="emails")
    add_history(app, queue="emails", state="cancelled")
    add_history(app, queue="emails", finished_at=datetime.now(UTC) - timedelta(hours=2))
    add_history(app, queue="archive")  # a queue with no live job left
    now = datetime.now(UTC)
    failed = make_job(queue="emails", state="dead", attempts=3)
    make_job(queue="emails", state="retryable", attempts=1)
    make_job(queue="reports")
    with app.connect() as conn:
        conn.execute(f"UPDATE {SCHEMA}.jobs SET attempted_at = %s WHERE id = %s", (now, failed))
        conn.commit()

    html = web.get("/").text

    emails = cells(html, "emails")
    assert (emails["completed_hour"], emails["failed_hour"]) == ("2", "1")
    assert cells(html, "archive")["completed_hour"] == "1"
    assert cells(html, "reports")["failed_hour"] == "0"
    totals = dict(re.findall(r'data-total="(\w+)">(\d+)<', html))
    assert totals["available"] == "1" and totals["dead"] == "1"
    assert totals["retryable"] == "1"
    assert (totals["completed_hour"], totals["failed_hour"]) == ("3", "1")


def test_overview_lists_a_paused_queue_without_jobs(app: skiplock.App, web: TestClient) -> None:
    with app.connect() as conn:
        client.set_queue_paused(conn, app.schema, "idle", paused=True)
        conn.commit()

    assert cells(web.get("/").text, "idle")["available"] == "0"


def test_jobs_list_reads_live_jobs_and_history_newest_first(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    live = make_job(task="a")
    done = add_history(app, task="b")
    dead = make_job(task="c", state="dead")

    html = web.get("/jobs").text

    order = [int(i) for i in re.findall(r'<tr data-job="(\d+)">', html)]
    assert order == [dead, done, live]
    assert [int(i) for i in re.findall(r'data-job="(\d+)"', web.get("/jobs?state=completed").text)]
    assert re.findall(r'data-job="(\d+)"', web.get("/jobs?state=completed").text) == [str(done)]
    assert re.findall(r'data-job="(\d+)"', web.get("/jobs?state=dead").text) == [str(dead)]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("queue=emails", {"email_live", "email_done"}),
        ("task=shop.charge", {"charge_dead"}),
        ("args=order-77", {"charge_dead", "email_done"}),
        ("args=50%25", {"percent"}),
        ("error=PaymentDeclined", {"charge_dead"}),
        ("state=available&queue=emails", {"email_live"}),
        # Live jobs by when they were enqueued, finished ones by when they finished.
        ("from=2000-01-01T00:00&to=2000-01-03T00:00", {"old", "old_done"}),
    ],
)
def test_jobs_filters(
    app: skiplock.App, make_job: JobFactory, web: TestClient, query: str, expected: set[str]
) -> None:
    ids = {
        "email_live": make_job(task="shop.email", queue="emails", args={"to": "a@example.com"}),
        "email_done": add_history(
            app, task="shop.email", queue="emails", args={"order": "order-77"}
        ),
        "charge_dead": make_job(
            task="shop.charge", state="dead", args={"order": "order-77"}, errors=[ERROR]
        ),
        "percent": make_job(task="shop.discount", args={"off": "50%"}),
        "old": make_job(task="shop.old"),
        "old_done": add_history(app, finished_at=datetime(2000, 1, 2, 12, tzinfo=UTC)),
    }
    with app.connect() as conn:
        conn.execute(
            f"UPDATE {SCHEMA}.jobs SET created_at = '2000-01-02T00:00Z' WHERE id = %s",
            (ids["old"],),
        )
        conn.commit()

    html = web.get(f"/jobs?{query}").text

    shown = {int(i) for i in re.findall(r'<tr data-job="(\d+)">', html)}
    assert shown == {ids[name] for name in expected}


def test_jobs_are_found_by_tag_live_and_finished_and_show_their_tags(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    @app.task(name="shop.invoice", tags=["billing", "eu"])
    def invoice(n: int) -> None: ...

    with app.connect() as conn:
        live = int(invoice.enqueue(conn, n=1))
        other = int(invoice.with_options(tags=["us"]).enqueue(conn, n=2))
        conn.commit()
    done = add_history(app, task="shop.invoice")
    odd = make_job(task="shop.odd")
    with app.connect() as conn:
        conn.execute(
            f"UPDATE {SCHEMA}.job_history SET meta = %s WHERE id = %s",
            (Jsonb({"tags": ["billing"]}), done),
        )
        # Written by hand: not a list of strings. The pages show what is a string, if any.
        conn.execute(
            f"UPDATE {SCHEMA}.jobs SET meta = %s WHERE id = %s",
            (Jsonb({"tags": ["<b>x</b>", 7]}), odd),
        )
        conn.commit()

    html = web.get("/jobs?tag=billing").text
    assert {int(i) for i in re.findall(r'<tr data-job="(\d+)">', html)} == {live, done}
    assert '<a class="tag" href="/jobs?tag=eu">eu</a>' in html
    assert {int(i) for i in re.findall(r'<tr data-job="(\d+)">', web.get("/jobs?tag=us").text)} == {
        other
    }
    page = web.get(f"/jobs/{live}").text
    assert re.search(r'<dd id="job-tags">.*billing.*eu.*</dd>', page)
    everything = web.get("/jobs").text
    assert "&lt;b&gt;x&lt;/b&gt;" in everything and "<b>x</b>" not in everything
    assert web.get(f"/jobs/{odd}").status_code == 200
    bad = web.get("/jobs?tag=has%20space")
    assert bad.status_code == 400
    assert "tag=&#39;has space&#39;" in bad.text


def test_a_job_that_failed_once_shows_each_attempt_its_worker_and_its_times(
    app: skiplock.App, web: TestClient, start_worker: StartWorker
) -> None:
    calls: list[int] = []

    @app.task(name="shop.flaky", retry=skiplock.RetryPolicy(base=0.01, cap=0.01, jitter=0.0))
    def flaky() -> str:
        calls.append(1)
        skiplock.set_progress({"done": 3, "of": 4})
        if len(calls) == 1:
            raise TimeoutError("the first try times out")
        return "ok"

    with app.connect() as conn:
        job_id = int(flaky.enqueue(conn))
        conn.commit()
    worker = start_worker(app).worker

    def finished() -> bool:
        with app.connect() as conn:
            return client.get_job(conn, app.schema, job_id).state == "completed"

    wait_until(finished, 20, "the job to complete on its second attempt")
    with app.connect() as conn:
        (failure,) = client.get_job(conn, app.schema, job_id).errors
    assert failure["worker"] == str(worker.id)
    assert datetime.fromisoformat(failure["claimed_at"]) <= datetime.fromisoformat(failure["at"])

    page = web.get(f"/jobs/{job_id}").text
    short = str(worker.id)[:8]
    assert f"attempt 1 claimed by worker {short}" in page
    assert "attempt 1 failed: TimeoutError" in page
    assert f"attempt 2 claimed by worker {short}" in page
    assert f"worker <code>{worker.id}</code>" in page
    assert re.search(r'<dd id="job-waited">\d+\.\d s</dd>', page)
    assert re.search(r'<dd id="job-ran">\d+\.\d s</dd>', page)
    assert '<progress id="progress-bar" max="1" value="0.75"></progress> 75%' in page
    row = re.search(rf'<tr data-job="{job_id}">(.*?)</tr>', web.get("/jobs").text, re.S)
    assert row and re.search(r"<td class=\"num\" data-ran>\d+\.\d s</td>", row[1])


def test_jobs_bad_filters_are_named(web: TestClient) -> None:
    response = web.get("/jobs?state=finished")
    assert response.status_code == 400
    assert "state=&#39;finished&#39; is not a job state" in response.text
    response = web.get("/jobs?from=yesterday")
    assert response.status_code == 400
    assert "is not a time" in response.text
    assert web.get("/jobs?before=abc").status_code == 400


def test_jobs_pages_by_keyset_across_live_jobs_and_history(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    made = []
    for n in range(120):
        made.append(make_job(args={"n": n}) if n % 2 else add_history(app, args={"n": n}))
    newest_first = sorted(made, reverse=True)

    seen: list[int] = []
    url: str | None = "/jobs"
    pages = 0
    while url:
        html = web.get(url).text
        seen += [int(i) for i in re.findall(r'<tr data-job="(\d+)">', html)]
        link = re.search(r'href="([^"]+)" id="next-page"', html)
        url = link[1].replace("&amp;", "&") if link else None
        if url:
            assert "before=" in url and "offset" not in url
        pages += 1

    assert pages == 3
    assert seen == newest_first


def test_job_page_shows_everything_about_a_job(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    job_id = make_job(task="shop.charge", state="dead", args={"order": 7}, errors=[ERROR])
    with app.connect() as conn:
        conn.execute(
            f"UPDATE {SCHEMA}.jobs SET ordering_key = 'customer-9', key_limit = 2, "
            "key_rate = 10, key_period = 60, progress = '{\"step\": 3}' WHERE id = %s",
            (job_id,),
        )
        conn.commit()
    done = add_history(app, task="shop.total", result={"total": 42})

    html = web.get(f"/jobs/{job_id}").text
    assert '<span class="state state-dead" id="job-state">dead</span>' in html
    assert "&#34;order&#34;: 7" in html
    assert "&#34;step&#34;: 3" in html
    assert "customer-9" in html and "at most 2 at once" in html and "at most 10 per 60 s" in html
    assert "PaymentDeclined</span>: card refused" in html
    # The traceback line by line, skiplock's own frame dimmed, the handler's not.
    assert re.search(r'<span class="machinery">\s+File &#34;[^&]*skiplock/executor.py', html)
    assert re.search(r"<span>\s+File &#34;/srv/shop/tasks.py&#34;", html)
    assert "attempt 1 failed: PaymentDeclined" in html and "enqueued" in html

    finished = web.get(f"/jobs/{done}").text
    assert "&#34;total&#34;: 42" in finished and "completed" in finished
    assert 'id="retry"' not in finished and 'id="cancel"' not in finished

    with app.connect() as conn:
        conn.execute(
            f"UPDATE {SCHEMA}.jobs SET state = 'waiting', wait_key = 'payment:<7>', "
            "wait_step = 'wait:payment:<7>', wait_until = now() + interval '1 hour' "
            "WHERE id = %s",
            (job_id,),
        )
        conn.commit()
        conn.execute(
            f"INSERT INTO {SCHEMA}.job_steps (job_id, name, attempt, result) VALUES "
            "(%s, 'charge <card>', 1, '{\"id\": \"ch_7\"}'), (%s, 'wait:payment:<7>', 1, NULL)",
            (job_id, job_id),
        )
        conn.commit()
    waiting = web.get(f"/jobs/{job_id}").text
    steps = re.search(r'<table id="steps">(.*?)</table>', waiting, re.S)
    assert steps and "<code>charge &lt;card&gt;</code>" in steps[1], waiting
    assert "&#34;id&#34;: &#34;ch_7&#34;" in steps[1]
    assert "step &#39;charge &lt;card&gt;&#39; recorded, attempt 1" in waiting
    assert "waits for signal &#39;payment:&lt;7&gt;&#39;" in waiting
    assert re.search(r'id="job-waits">signal <code>payment:&lt;7&gt;</code>, until \d{4}-', waiting)

    missing = web.get("/jobs/987654")
    assert missing.status_code == 404
    assert "no job with id 987654" in missing.text


def test_cron_page_shows_schedules_with_next_fire(app: skiplock.App) -> None:
    @app.periodic("*/5 * * * *", name="reports.nightly", queue="reports")
    def nightly() -> None: ...

    with app.connect() as conn:
        conn.execute(
            f"INSERT INTO {SCHEMA}.periodic (name, last_tick) VALUES "
            "('reports.nightly', now() - interval '3 minutes'), ('gone.task', now())"
        )
        conn.commit()
    with TestClient(
        create_app(app.database_url, app.schema, app=app), base_url="http://localhost"
    ) as web:
        html = web.get("/cron").text

    row = re.search(r"reports\.nightly</a></td>(.*?)</tr>", html, re.S)
    assert row
    assert "*/5 * * * *" in row[1] and "reports" in row[1]
    fire = re.findall(r"(\d{4}-\d\d-\d\d \d\d:(\d\d):00Z)", row[1])
    assert fire and int(fire[-1][1]) % 5 == 0, "the next fire falls on a 5-minute mark"
    assert "gone.task" in html, "a schedule the App no longer defines still shows its last tick"


def test_cron_page_without_the_app_shows_and_steers_what_workers_described(
    app: skiplock.App, web: TestClient
) -> None:
    with app.connect() as conn:
        conn.execute(
            f"INSERT INTO {SCHEMA}.periodic (name, last_tick, expression, task, queue, "
            "priority, max_attempts, args, missed, next_tick) VALUES ('reports.nightly', "
            "now(), '0 3 * * *', 'reports.nightly', 'reports', 0, 3, '{\"full\": true}', "
            "'latest', now() + interval '1 hour')"
        )
        conn.commit()

    html = web.get("/cron").text
    row = re.search(r'<tr data-schedule="reports.nightly">(.*?)</tr>', html, re.S)
    assert row, html
    assert "<code>0 3 * * *</code>" in row[1] and ">active<" in row[1]
    assert "no description yet" not in html

    post(web, "/cron/reports.nightly/pause", next="/cron")
    assert ">paused<" in web.get("/cron").text
    response = post(web, "/cron/reports.nightly/run-now", next="/cron")
    found = re.search(r"schedule reports.nightly: job (\d+) enqueued now", response.text)
    assert found is not None, response.text
    with app.connect() as conn:
        job = client.get_job(conn, app.schema, int(found[1]))
    assert (job.task, job.queue, job.args) == ("reports.nightly", "reports", {"full": True})
    refused = post(web, "/cron/gone/pause").text
    assert "no cron schedule" in refused and "gone" in refused


# -- actions -----------------------------------------------------------------------------


def test_retry_cancel_and_delete_one_job(
    app: skiplock.App, make_job: JobFactory, web: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="skiplock.dashboard")
    dead = make_job(state="dead", attempts=3)
    waiting = make_job()
    doomed = make_job(state="dead")

    response = post(web, f"/jobs/{dead}/retry", next=f"/jobs/{dead}")
    assert response.status_code == 200
    assert f"job {dead}: retry done" in response.text
    assert job_state(app, dead) == "available"
    post(web, f"/jobs/{waiting}/cancel")
    assert job_state(app, waiting) == "cancelled"
    post(web, f"/jobs/{doomed}/delete")
    with app.connect() as conn, pytest.raises(skiplock.JobNotFoundError):
        client.get_job(conn, app.schema, doomed)

    logged = [r.getMessage() for r in caplog.records if r.name == "skiplock.dashboard"]
    assert any("retry by testclient" in m and f"[{dead}]" in m for m in logged), logged
    assert any("delete by testclient" in m and f"[{doomed}]" in m for m in logged), logged


def test_an_action_that_cannot_apply_says_why(app: skiplock.App, web: TestClient) -> None:
    done = add_history(app)
    response = post(web, f"/jobs/{done}/cancel")
    assert "has finished (completed) and is in history" in response.text


def test_a_finished_job_offers_run_again_and_runs_a_copy(
    app: skiplock.App, web: TestClient
) -> None:
    done = add_history(app, task="shop.send", args={"order_id": 7})
    page = web.get(f"/jobs/{done}").text
    assert 'id="replay">Run again</button>' in page
    assert 'id="retry"' not in page

    response = post(web, f"/jobs/{done}/retry", next=f"/jobs/{done}")

    found = re.search(rf"job {done} enqueued again as job (\d+)", response.text)
    assert found is not None, response.text
    copy = int(found[1])
    with app.connect() as conn:
        replayed = client.get_job(conn, app.schema, copy)
    assert (replayed.state, replayed.task, replayed.args) == (
        "available",
        "shop.send",
        {"order_id": 7},
    )
    assert job_state(app, done) == "completed"  # history keeps the original as it ended


def test_cancel_asks_the_worker_of_a_running_job(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    import uuid  # noqa: PLC0415

    running = make_job(
        state="running",
        attempts=1,
        worker_id=uuid.uuid4(),
        lease_expires_at=datetime.now(UTC) + timedelta(minutes=5),
    )
    post(web, f"/jobs/{running}/cancel")
    with app.connect() as conn:
        assert client.get_job(conn, app.schema, running).cancel_requested_at is not None


def test_bulk_actions_on_a_selection_and_on_every_match(
    app: skiplock.App, make_job: JobFactory, web: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="skiplock.dashboard")
    first, second, third = (make_job(state="dead", queue="emails") for _ in range(3))
    other = make_job(state="dead", queue="reports")

    response = web.post(
        "/bulk",
        data={"csrf": csrf(web), "action": "retry", "ids": [str(first), str(second)], "next": "/"},
    )
    assert "2 of 2 jobs made available again" in response.text
    assert [job_state(app, i) for i in (first, second, third)] == ["available", "available", "dead"]

    response = post(web, "/bulk", action="retry:matching", state="dead", queue="emails")
    assert "1 of 1 job made available again" in response.text
    assert job_state(app, third) == "available"
    assert job_state(app, other) == "dead"
    assert any(
        "all matching" in r.getMessage() and f"[{third}]" in r.getMessage() for r in caplog.records
    )

    response = post(web, "/bulk", action="delete:matching", queue="emails")
    assert "3 of 3 jobs deleted" in response.text
    assert post(web, "/bulk", action="explode").status_code == 400


def test_pause_resume_and_limit_a_queue(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    make_job(queue="emails")

    post(web, "/queues/emails/pause")
    with app.connect() as conn:
        assert client.paused_queues(conn, app.schema) == ["emails"]
    assert "Resume" in web.get("/").text
    post(web, "/queues/emails/resume")
    with app.connect() as conn:
        assert client.paused_queues(conn, app.schema) == []

    post(web, "/queues/emails/limits", concurrency="4", rate="600/minute")
    with app.connect() as conn:
        (row,) = client.list_queues(conn, app.schema)
    assert (row["concurrency_limit"], row["rate_limit"], row["rate_period"]) == (4, 600, 60.0)

    response = post(web, "/queues/emails/limits", concurrency="many")
    assert response.status_code == 400
    assert "concurrency &#39;many&#39; is not a whole number" in response.text
    response = post(web, "/queues/emails/limits", rate="fast")
    assert response.status_code == 400
    assert "write jobs/period" in response.text

    post(web, "/queues/emails/limits")
    with app.connect() as conn:
        (row,) = client.list_queues(conn, app.schema)
    assert row["concurrency_limit"] is None and row["rate_limit"] is None


# -- security ------------------------------------------------------------------------------


def test_read_only_hides_and_refuses_actions(app: skiplock.App, make_job: JobFactory) -> None:
    dead = make_job(state="dead", queue="emails")
    with TestClient(
        create_app(app.database_url, app.schema, read_only=True), base_url="http://localhost"
    ) as web:
        for page in ("/", "/jobs", f"/jobs/{dead}"):
            html = web.get(page).text
            assert 'method="post"' not in html, page
            assert "read-only" in html
        response = post(web, f"/jobs/{dead}/retry")
        assert response.status_code == 403
        assert "read-only" in response.text
        assert post(web, "/queues/emails/pause").status_code == 403
        assert post(web, "/bulk", action="delete:matching").status_code == 403
    assert job_state(app, dead) == "dead"
    with app.connect() as conn:
        assert client.paused_queues(conn, app.schema) == []


def test_actions_without_the_csrf_token_or_from_another_site_are_refused(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    dead = make_job(state="dead")
    assert web.post(f"/jobs/{dead}/retry", data={"next": "/"}).status_code == 403
    assert web.post(f"/jobs/{dead}/retry", data={"csrf": "guess"}).status_code == 403
    response = web.post(
        f"/jobs/{dead}/retry",
        data={"csrf": csrf(web)},
        headers={"Origin": "https://evil.example"},
    )
    assert response.status_code == 403
    assert "another site" in response.text
    assert job_state(app, dead) == "dead"
    # The same form from the dashboard's own origin goes through.
    response = web.post(
        f"/jobs/{dead}/retry",
        data={"csrf": csrf(web), "next": "/"},
        headers={"Origin": "http://localhost"},
    )
    assert response.status_code == 200
    assert job_state(app, dead) == "available"


def test_a_token_guards_every_page_and_action(app: skiplock.App, make_job: JobFactory) -> None:
    dead = make_job(state="dead")
    with TestClient(
        create_app(app.database_url, app.schema, token="s3cret-token"), base_url="http://localhost"
    ) as web:
        response = web.get("/jobs", follow_redirects=False)
        assert response.status_code == 303
        assert response.headers["location"].startswith("/login?next=")
        assert post(web, f"/jobs/{dead}/retry").status_code == 403
        assert job_state(app, dead) == "dead"

        bearer = {"Authorization": "Bearer s3cret-token"}
        assert web.get("/jobs", headers=bearer).status_code == 200
        assert (
            web.get(
                "/jobs", headers={"Authorization": "Bearer wrong"}, follow_redirects=False
            ).status_code
            == 303
        )

        token_csrf = csrf(web, "/login")
        wrong = web.post("/login", data={"csrf": token_csrf, "token": "nope", "next": "/"})
        assert wrong.status_code == 403
        signed = web.post(
            "/login", data={"csrf": token_csrf, "token": "s3cret-token", "next": "/jobs"}
        )
        assert signed.status_code == 200
        assert "s3cret-token" not in (web.cookies.get(security.AUTH_COOKIE) or "")
        post(web, f"/jobs/{dead}/retry")
        assert job_state(app, dead) == "available"


def test_a_reachable_address_needs_a_token_or_read_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert security.is_loopback("127.0.0.1") and security.is_loopback("::1")
    assert security.is_loopback("localhost")
    assert not security.is_loopback("0.0.0.0") and not security.is_loopback("example.com")
    security.check_startup("127.0.0.1", token=None, read_only=False)
    security.check_startup("0.0.0.0", token=None, read_only=True)
    security.check_startup("0.0.0.0", token="t", read_only=False)
    with pytest.raises(ConfigurationError, match="SKIPLOCK_DASHBOARD_TOKEN"):
        security.check_startup("0.0.0.0", token=None, read_only=False)

    monkeypatch.delenv(security.TOKEN_ENV, raising=False)
    assert main(["--database-url", "postgresql://nowhere/x", "dashboard", "--host", "0.0.0.0"]) == 2
    assert "SKIPLOCK_DASHBOARD_TOKEN" in capsys.readouterr().err


def test_a_host_name_it_does_not_serve_is_refused_before_any_handler(
    app: skiplock.App, make_job: JobFactory
) -> None:
    """DNS rebinding: a page of another site points its own name at 127.0.0.1, and the
    browser, which still thinks it talks to that site, sends its name as Host. Nothing but
    the refusal is answered to such a request: no page, no action."""
    dead = make_job(state="dead", args={"card": "4111-secret"})
    asgi = create_app(app.database_url, app.schema)
    with TestClient(asgi, base_url="http://rebound.example:8089") as foreign:
        for path in ("/", "/jobs", f"/jobs/{dead}", "/cron", "/static/dashboard.js"):
            response = foreign.get(path)
            assert response.status_code == 403, (path, response.status_code)
            assert "4111-secret" not in response.text
            assert "--allowed-host rebound.example" in response.text, response.text
        token = str(foreign.cookies.get(security.CSRF_COOKIE) or "guess")
        refused = foreign.post(
            f"/jobs/{dead}/retry",
            data={"csrf": token, "next": "/"},
            cookies={security.CSRF_COOKIE: token},
            headers={"Origin": "http://rebound.example:8089"},
        )
        assert refused.status_code == 403
    assert job_state(app, dead) == "dead"
    # The names it serves by default: localhost and IP addresses (a rebinding needs a name).
    for base in ("http://localhost:8089", "http://127.0.0.1:8089", "http://[::1]:8089"):
        with TestClient(asgi, base_url=base) as local:
            assert local.get(f"/jobs/{dead}").status_code == 200, base


def test_allowed_hosts_add_names_and_origin_is_checked_against_them(
    app: skiplock.App, make_job: JobFactory
) -> None:
    dead = make_job(state="dead")
    asgi = create_app(app.database_url, app.schema, allowed_hosts=["queue.example.com"])
    with TestClient(asgi, base_url="https://queue.example.com") as named:
        assert named.get("/").status_code == 200
        assert named.get("/", headers={"Host": "QUEUE.example.com."}).status_code == 200
        assert named.get("/", headers={"Host": "other.example.com"}).status_code == 403
    # Behind a reverse proxy that talks to the dashboard on 127.0.0.1 and names the
    # browser's host in X-Forwarded-Host: the Origin must be one of the allowed hosts too.
    with TestClient(asgi, base_url="http://127.0.0.1:8089") as proxied:
        token = csrf(proxied)
        refused = proxied.post(
            f"/jobs/{dead}/retry",
            data={"csrf": token, "next": "/"},
            headers={"Origin": "https://rebound.example", "X-Forwarded-Host": "rebound.example"},
        )
        assert refused.status_code == 403
        assert "--allowed-host" in refused.text
        assert job_state(app, dead) == "dead"
        accepted = proxied.post(
            f"/jobs/{dead}/retry",
            data={"csrf": token, "next": "/"},
            headers={
                "Origin": "https://queue.example.com",
                "X-Forwarded-Host": "queue.example.com",
            },
        )
        assert accepted.status_code == 200
    assert job_state(app, dead) == "available"
    with pytest.raises(ConfigurationError, match="allowed host"):
        create_app(app.database_url, app.schema, allowed_hosts=["https://queue.example.com"])


def test_the_command_serves_its_host_and_the_allowed_names(
    app: skiplock.App, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import uvicorn  # noqa: PLC0415

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **_options: served.append(asgi))
    monkeypatch.setenv(security.ALLOWED_HOSTS_ENV, "ops.example.com, status.example.com")
    command = ["--database-url", app.database_url, "dashboard", "--allowed-host", "queue.lan"]
    assert main([*command, "--host", "dash.lan", "--read-only"]) == 0
    with TestClient(served[0], base_url="http://localhost") as web:
        for name in ("queue.lan", "ops.example.com", "status.example.com", "dash.lan"):
            assert web.get("/", headers={"Host": f"{name}:8089"}).status_code == 200, name
        assert web.get("/", headers={"Host": "other.lan:8089"}).status_code == 403

    monkeypatch.delenv(security.ALLOWED_HOSTS_ENV)
    assert main([*command, "--allowed-host", "https://queue.lan:8089"]) == 2
    assert "allowed host 'https://queue.lan:8089' is not a host name" in capsys.readouterr().err


def test_arguments_are_escaped_everywhere(app: skiplock.App, make_job: JobFactory) -> None:
    hostile = "<script>window.__pwned=1</script>"
    job_id = make_job(
        task="t", queue="q<b>", args={"html": hostile}, state="dead",
        errors=[{**ERROR, "message": hostile, "traceback": hostile}],
    )  # fmt: skip
    with TestClient(create_app(app.database_url, app.schema), base_url="http://localhost") as web:
        for page in ("/", "/jobs", f"/jobs/{job_id}", "/jobs?args=%3Cscript%3E"):
            response = web.get(page)
            assert "<script>window" not in response.text, page
            assert "<b>" not in response.text, page
            assert "default-src 'self'" in response.headers["content-security-policy"]
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in web.get(f"/jobs/{job_id}").text


def test_next_never_leaves_the_dashboard(
    app: skiplock.App, make_job: JobFactory, web: TestClient
) -> None:
    dead = make_job(state="dead")
    response = web.post(
        f"/jobs/{dead}/retry",
        data={"csrf": csrf(web), "next": "//evil.example/x"},
        follow_redirects=False,
    )
    assert response.headers["location"] == "/"
    response = web.post(
        f"/jobs/{dead}/retry",
        data={"csrf": csrf(web), "next": "/\t/evil.example/x"},
        follow_redirects=False,
    )
    assert response.headers["location"] == "/"


# -- mounting ---------------------------------------------------------------------------


def test_mounted_under_a_prefix_links_stay_under_it(
    app: skiplock.App, make_job: JobFactory
) -> None:
    dead = make_job(state="dead")
    outer = Starlette(routes=[Mount("/ops/queue", create_app(app.database_url, app.schema))])
    with TestClient(outer, base_url="http://localhost") as web:
        html = web.get("/ops/queue/").text
        assert 'href="/ops/queue/jobs"' in html
        assert 'href="/ops/queue/static/dashboard.css"' in html
        assert web.get("/ops/queue/static/dashboard.js").status_code == 200
        assert f'href="/ops/queue/jobs/{dead}"' in web.get("/ops/queue/jobs").text
        response = web.post(
            f"/ops/queue/jobs/{dead}/retry",
            data={"csrf": csrf(web, "/ops/queue/"), "next": "/jobs"},
            follow_redirects=False,
        )
        assert response.headers["location"] == "/ops/queue/jobs"
    assert job_state(app, dead) == "available"


def test_behind_a_proxy_that_strips_the_root_path(app: skiplock.App) -> None:
    with TestClient(
        create_app(app.database_url, app.schema, root_path="/q"), base_url="http://localhost"
    ) as web:
        html = web.get("/jobs").text
        assert 'href="/q/static/dashboard.css"' in html
        assert 'data-refresh="/q/jobs?fragment=1"' in html
    with pytest.raises(ConfigurationError, match="root_path"):
        create_app(app.database_url, app.schema, root_path="q/")


def test_fragment_is_the_live_part_only(web: TestClient, make_job: JobFactory) -> None:
    make_job()
    full = web.get("/jobs?state=available").text
    part = web.get("/jobs?state=available&fragment=1").text
    assert "<html" in full and 'data-refresh="/jobs?state=available&amp;fragment=1"' in full
    assert "<html" not in part and 'id="jobs"' in part


def test_an_unmigrated_schema_names_the_command(app: skiplock.App) -> None:
    with TestClient(
        create_app(app.database_url, "not_migrated"), base_url="http://localhost"
    ) as web:
        response = web.get("/")
    assert response.status_code == 503
    assert "skiplock migrate" in response.text


# -- pure decisions -------------------------------------------------------------------


def test_merge_page_keeps_the_newest_and_the_cursor() -> None:
    live = [{"id": 9}, {"id": 5}, {"id": 2}]
    finished = [{"id": 8}, {"id": 4}]
    page = reads.merge_page(live, finished, 3)
    assert [j["id"] for j in page.jobs] == [9, 8, 5]
    assert page.next_before == 5
    assert reads.merge_page([{"id": 1}], [], 3).next_before is None


def test_like_escape_matches_literally() -> None:
    assert reads.like_escape("50%_a\\b") == "50\\%\\_a\\\\b"


def test_traceback_lines_mark_machinery() -> None:
    marked = reads.traceback_lines(ERROR["traceback"])
    machinery = [line for line, dim in marked if dim]
    own = [line for line, dim in marked if not dim]
    assert any("executor.py" in line for line in machinery)
    assert any("/srv/shop/tasks.py" in line for line in own)
    assert own[-1] == "PaymentDeclined: card refused"


def test_error_entries_show_whatever_was_stored() -> None:
    assert reads.error_entries(None) == []
    (entry,) = reads.error_entries([ERROR])
    assert (entry["attempt"], entry["type"], entry["message"]) == (
        "1",
        "PaymentDeclined",
        "card refused",
    )
    assert entry["lines"][-1] == ("PaymentDeclined: card refused", False)
    odd = reads.error_entries(["text", None, {"traceback": {"a": 1}, "message": 5}])
    assert [e["message"] for e in odd] == ["text", "null", "5"]
    assert [e["type"] for e in odd] == ["?", "?", "?"]
    assert odd[2]["lines"] == [("{", False), ('  "a": 1', False), ("}", False)]
    assert reads.error_entries({"type": "Alone"})[0]["type"] == "Alone"
    assert reads.last_error_type([ERROR, {"message": "m"}]) == "?"
    assert reads.last_error_type(42) == "?" and reads.last_error_type([]) == ""


def test_the_timeline_shows_each_attempt_claimed_by_its_worker_and_its_end() -> None:
    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    job: dict[str, Any] = {
        "created_at": t0,
        "run_at": t0,
        "state": "completed",
        "attempts": 2,
        "attempted_at": t0 + timedelta(seconds=40),
        "worker_ids": ["aaaaaaaa-1111", "bbbbbbbb-2222"],
        "worker_id": None,
        "finished_at": t0 + timedelta(seconds=45),
        "errors": [
            {
                "attempt": 1,
                "at": (t0 + timedelta(seconds=12)).isoformat(),
                "type": "TimeoutError",
                "worker": "aaaaaaaa-1111",
                "claimed_at": (t0 + timedelta(seconds=2)).isoformat(),
            },
            # Written before attempts recorded their worker: its end alone.
            {"attempt": 0, "at": "not a time", "type": "Old"},
        ],
    }
    assert [(at - t0).total_seconds() for at, _ in reads.timeline(job)] == [0, 2, 12, 40, 45]
    assert [what for _, what in reads.timeline(job)] == [
        "enqueued",
        "attempt 1 claimed by worker aaaaaaaa",
        "attempt 1 failed: TimeoutError",
        "attempt 2 claimed by worker bbbbbbbb",
        "completed",
    ]
    # A dead job's last attempt is claimed once, not once from its error and once more.
    dead = job | {
        "state": "dead",
        "attempts": 1,
        "attempted_at": t0 + timedelta(seconds=2),
        "finished_at": None,
        "errors": job["errors"][:1],
    }
    assert [what for _, what in reads.timeline(dead)].count(
        "attempt 1 claimed by worker aaaaaaaa"
    ) == 1


def test_durations_wait_from_when_due_and_run_from_the_last_claim() -> None:
    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    now = t0 + timedelta(minutes=10)
    base = {"created_at": t0, "run_at": None, "started_at": None, "attempted_at": None}
    assert reads.durations(base | {"state": "available"}, now) == (None, None)
    finished = base | {
        "state": "completed",
        "started_at": t0 + timedelta(seconds=3),
        "attempted_at": t0 + timedelta(seconds=3),
        "finished_at": t0 + timedelta(seconds=8),
    }
    assert reads.durations(finished, now) == (3.0, 5.0)
    # Due later than enqueued: the wait counts from the run time.
    scheduled = finished | {"run_at": t0 + timedelta(seconds=2)}
    assert reads.durations(scheduled, now) == (1.0, 5.0)
    # A run time set after the first start (a snooze): the wait counts from the enqueue.
    snoozed = finished | {"run_at": t0 + timedelta(seconds=60)}
    assert reads.durations(snoozed, now) == (3.0, 5.0)
    running = finished | {"state": "running", "finished_at": None}
    assert reads.durations(running, now) == (3.0, 597.0)
    failed = running | {
        "state": "dead",
        "errors": [{"at": (t0 + timedelta(seconds=9)).isoformat()}],
    }
    assert reads.durations(failed, now) == (3.0, 6.0)


@pytest.mark.parametrize(
    ("progress", "fraction"),
    [
        ({"done": 40, "of": 100}, 0.4),
        ({"current": 3, "total": 4}, 0.75),
        ({"percent": 12.5}, 0.125),
        (0.5, 0.5),
        ({"done": 5, "of": 0}, None),
        ({"done": 150, "of": 100}, 1.0),
        ({"step": 3}, None),
        (7, None),
        (True, None),
        ("half", None),
        ({"done": float("nan"), "of": 2}, None),
    ],
)
def test_progress_as_a_fraction_when_it_says_how_far(progress: Any, fraction: float | None) -> None:
    assert reads.progress_fraction(progress) == fraction


def test_host_names_and_origins() -> None:
    allowed = security.allowed_hosts(["Queue.Example.com.", "[::1]"])
    assert allowed == {"queue.example.com", "::1"}
    assert security.host_name("LOCALHOST:8089") == "localhost"
    assert security.host_name("[::1]:8089") == "::1"
    for bad in (None, "", "evil@localhost", "a b", "localhost:port", "[::1", "x/y"):
        assert security.host_name(bad) is None, bad
    assert security.host_allowed("10.1.2.3", allowed) and security.host_allowed("localhost", ())
    assert not security.host_allowed("localhost.evil.example", allowed)
    assert not security.host_allowed("sub.queue.example.com", allowed)
    same = ["localhost:8089", None]
    assert security.origin_refusal(None, same, allowed) is None
    assert security.origin_refusal("http://localhost:8089", same, allowed) is None
    assert "another site" in (security.origin_refusal("null", same, allowed) or "")
    assert "another site" in (security.origin_refusal("http://localhost:3000", same, allowed) or "")
    refusal = security.origin_refusal("https://evil.example", ["evil.example"], allowed)
    assert refusal and "--allowed-host evil.example" in refusal
    for bad in ("https://x.example", "x.example:80", "*.example.com", "a/b", ""):
        with pytest.raises(ConfigurationError, match="is not a host name"):
            security.allowed_hosts([bad])
    with pytest.raises(ConfigurationError, match="list of host names"):
        security.allowed_hosts("queue.example.com")


def test_mounted_in_fastapi(app: skiplock.App, make_job: JobFactory) -> None:
    from fastapi import FastAPI  # noqa: PLC0415

    job_id = make_job(queue="emails")
    api = FastAPI()
    api.mount("/admin/queue", create_app(app.database_url, app.schema, read_only=True))
    with TestClient(api, base_url="http://localhost") as web:
        html = web.get("/admin/queue/jobs").text
        assert f'href="/admin/queue/jobs/{job_id}"' in html
        assert web.get(f"/admin/queue/jobs/{job_id}").status_code == 200


def test_error_pages_do_not_poll(app: skiplock.App, make_job: JobFactory, web: TestClient) -> None:
    dead = make_job(state="dead")
    refused = web.post(f"/jobs/{dead}/retry", data={"csrf": "wrong"})
    assert refused.status_code == 403
    assert "data-refresh=" not in refused.text


# -- rows written by hand ------------------------------------------------------------------

# Rows the tables' constraints allow but no skiplock code writes, as another program's
# plain SQL could: odd queue and task names, JSON of any shape where skiplock writes
# objects and arrays, JSON Python cannot load (too deep, a number too long), timestamps
# Python cannot hold (infinity, years past 9999 or before 1). Each is a literal INSERT.
DEEP = "('{\"deep\": ' || repeat('[', 3000) || repeat(']', 3000) || '}')::jsonb"
LONG_NUMBER = "'{\"n\": 1e5000}'::jsonb"
ODD_QUEUES = ["a/b", "..", ".", " spaced ", "50%", "q?x=1#top", "ünï/côdé", "<b>q</b>", "q" * 128]
ODD_JOBS = [
    "(queue, task) VALUES ('a/b', 'shop/tasks.charge')",
    "(queue, task, state, errors) VALUES ('..', 'no.type', 'dead', "
    '\'[{"message": "no type here", "attempt": 1}]\')',
    "(queue, task, state, errors) VALUES ('.', 'not.objects', 'dead', "
    '\'["a plain string", 42, null, [1, 2], {"type": null}]\')',
    "(task, state, retry_at, errors) VALUES ('traceback.not.text', 'retryable', now(), "
    '\'[{"type": "E", "message": {"nested": true}, "traceback": {"not": "text"}, '
    '"at": 12345, "attempt": "first"}, {"type": 7, "traceback": ["line one"], '
    '"at": "99999-01-01T00:00:00"}, {"type": "E", "traceback": 42, "at": "soon"}]\')',
    "(task, state, errors) VALUES ('errors.object', 'dead', '{\"type\": \"NotAList\"}')",
    "(task, state, errors) VALUES ('errors.text', 'dead', '\"just text\"')",
    "(task, state, errors) VALUES ('errors.null', 'dead', 'null')",
    "(task, state, errors) VALUES ('errors.number', 'dead', '42')",
    f"(task, args, progress, meta) VALUES ('too.deep', {DEEP}, {DEEP}, {DEEP})",
    f"(task, args, progress, meta) VALUES ('long.number', {LONG_NUMBER}, {LONG_NUMBER}, '[]')",
    "(task, progress, meta) VALUES ('odd.progress', '\"halfway\"', '\"text\"')",
    "(task, progress, meta) VALUES ('null.progress', 'null', 'null')",
    "(queue, task, state, run_at) VALUES (' spaced ', 'never.due', 'scheduled', 'infinity')",
    "(queue, task, run_at, created_at) VALUES ('50%', 'always.due', '-infinity', '-infinity')",
    "(queue, task, created_at, attempted_at) VALUES ('q?x=1#top', 'far.future', "
    "'294276-12-31 23:59:59+00', 'infinity')",
    "(queue, task, created_at) VALUES ('ünï/côdé', 'before.year.one', '4713-01-01 00:00:00+00 BC')",
    "(task, state, retry_at, cancel_requested_at) VALUES ('retry.never', 'retryable', "
    "'-infinity', 'infinity')",
    "(task, state, worker_id, lease_expires_at, started_at, attempts, max_attempts) VALUES "
    "('lease.forever', 'running', gen_random_uuid(), 'infinity', '-infinity', 2147483647, 1)",
    "(queue, task, priority) VALUES ('<b>q</b>', '<script>alert(1)</script>', -32768)",
    f"(queue, task, priority) VALUES ('{'q' * 128}', '{'t' * 255}', 32767)",
    "(task) VALUES ('задача.отправить чек')",
    "(task) VALUES (E'tab\\there new\\nline ''quote'' \"double\" %s {0}')",
    "(task, state, ordering_key, key_limit, key_rate, key_period, unique_key) VALUES "
    "('odd.keys', 'blocked', '/', 32767, 1, 'Infinity', E'key\\nwith a line break')",
]
ODD_HISTORY = [
    "'completed', 'null', '[]', now(), NULL",
    "'completed', '\"a plain string\"', '[\"not an object\"]', now(), '\"odd\"'",
    f"'completed', {DEEP}, '[]', now(), {DEEP}",
    f"'completed', {LONG_NUMBER}, '{{\"type\": \"NotAList\"}}', 'infinity', '[]'",
    "'cancelled', NULL, '[{\"traceback\": 5, \"message\": null}]', '-infinity', NULL",
    "'cancelled', '[1, 2]', 'null', '294276-12-31 23:59:59+00', 'null'",
]


def write_odd_rows(conn: psycopg.Connection[Any]) -> dict[int, tuple[str, str]]:
    """Every odd row above, by plain SQL; job id -> (state, queue)."""
    made: dict[int, tuple[str, str]] = {}
    for columns_and_values in ODD_JOBS:
        row = conn.execute(
            f"INSERT INTO {SCHEMA}.jobs {columns_and_values} RETURNING id, state, queue"
        ).fetchone()
        assert row is not None
        made[row[0]] = (row[1], row[2])
    for n, history_values in enumerate(ODD_HISTORY):
        row = conn.execute(
            f"INSERT INTO {SCHEMA}.job_history (id, queue, task, args, state, priority, "
            "attempts, max_attempts, result, errors, created_at, finished_at, progress) "
            f"SELECT nextval('{SCHEMA}.jobs_id_seq'), 'a/b', 'history.odd.{n}', '{{}}', "
            f"state, 0, 1, 1, result::jsonb, errors::jsonb, now(), finished_at::timestamptz, "
            "progress::jsonb FROM (VALUES "
            f"({history_values})) AS v(state, result, errors, finished_at, progress) "
            "RETURNING id, state, queue"
        ).fetchone()
        assert row is not None
        made[row[0]] = (row[1], row[2])
    conn.execute(
        f"INSERT INTO {SCHEMA}.workers (id, host, pid, queues, concurrency, started_at, "
        "last_seen_at, service_restarts) VALUES "
        "(gen_random_uuid(), 'host/<odd>', -1, ARRAY[NULL, 'a/b', '']::text[], 0, "
        "'-infinity', 'infinity', '\"odd\"'), "
        "(gen_random_uuid(), 'host.ancient', 0, '{}', 1, 'infinity', '-infinity', 'null')"
    )
    conn.execute(
        f"INSERT INTO {SCHEMA}.queues (name, paused, concurrency_limit, rate_limit, "
        "rate_period) VALUES ('a/b', true, 1, 1, 'Infinity'), ('', true, NULL, NULL, NULL), "
        "('..', false, 2147483647, 2147483647, 1e-300)"
    )
    conn.execute(
        f"INSERT INTO {SCHEMA}.periodic (name, last_tick) VALUES ('odd.far', 'infinity'), "
        "('odd/ancient', '-infinity'), ('odd.year', '294276-12-31 23:59:59+00')"
    )
    conn.commit()
    return made


def test_every_page_shows_rows_written_by_hand(app: skiplock.App) -> None:
    @app.periodic("* * * * *", name="odd.far")
    def far() -> None: ...

    with app.connect() as conn:
        made = write_odd_rows(conn)
    with TestClient(create_app(app.database_url, app.schema, app=app), base_url=LOCAL) as web:

        def page(path: str) -> str:
            response = web.get(path)
            assert response.status_code == 200, (path, response.text[-2000:])
            return str(response.text)

        for path in ("/", "/?fragment=1"):
            html = page(path)
            for queue in [*ODD_QUEUES, ""]:
                assert f'data-queue="{escape(queue)}"' in html, (path, queue)
            assert "host/&lt;odd&gt;" in html and "host.ancient" in html
        for state in reads.STATES:
            html = page(f"/jobs?state={state}")
            for job_id, (job_state_, _queue) in made.items():
                if job_state_ == state:
                    assert f'data-job="{job_id}"' in html, (state, job_id)
        for queue in ODD_QUEUES:
            html = page(f"/jobs?{urlencode({'queue': queue})}")
            for job_id, (_state, job_queue) in made.items():
                if job_queue == queue:
                    assert f'data-job="{job_id}"' in html, (queue, job_id)
        for job_id in made:
            assert f"<h1>Job {job_id} " in page(f"/jobs/{job_id}")
        for path in ("/jobs", "/jobs?error=E", "/jobs?args=deep", "/jobs?from=2000-01-01"):
            page(path)
        cron = page("/cron")
        for name in ("odd.far", "odd/ancient", "odd.year"):
            assert f">{name}</a>" in cron, name

        # What each shows of itself.
        ids = {task: job_id for job_id, task in job_tasks(app).items()}
        no_type = page(f"/jobs/{ids['no.type']}")
        assert "no type here" in no_type
        odd_traceback = page(f"/jobs/{ids['traceback.not.text']}")
        assert "&#34;not&#34;: &#34;text&#34;" in odd_traceback and "line one" in odd_traceback
        assert "a plain string" in page(f"/jobs/{ids['not.objects']}")
        assert "NotAList" in page(f"/jobs/{ids['errors.object']}")
        deep = page(f"/jobs/{ids['too.deep']}")
        assert deep.count("[[[[[[[[[[") >= 3 * 300, "args, progress and meta as stored"
        assert '<pre id="meta">&#34;text&#34;</pre>' in page(f"/jobs/{ids['odd.progress']}")
        assert "00000000" in page(f"/jobs/{ids['long.number']}")
        assert "infinity" in page(f"/jobs/{ids['never.due']}")
        assert "294276-12-31" in page(f"/jobs/{ids['far.future']}")
        assert "BC" in page(f"/jobs/{ids['before.year.one']}")
        dead = page("/jobs?state=dead")
        assert "NotAList" in dead


def test_tolerant_loaders_last_only_for_the_read_that_needed_them(app: skiplock.App) -> None:
    """psycopg's own loaders are the fast ones: a read uses them, and only a read that
    failed on a value is repeated with the tolerant ones (values.read_tolerantly)."""
    far = "SELECT 'infinity'::timestamptz, ('[' || repeat('[', 3000) || repeat(']', 3001))::jsonb"
    with app.connect() as conn:
        oids = [conn.adapters.types[name].oid for name in ("timestamptz", "jsonb", "json")]
        before = [conn.adapters.get_loader(oid, Format.TEXT) for oid in oids]
        moment, deep = values.read_tolerantly(conn, lambda c: c.execute(far).fetchone())
        assert isinstance(moment, values.FarTime) and moment.text == "infinity"
        assert moment > datetime.now(UTC)
        assert isinstance(deep, values.RawJson) and deep.startswith("[[[[")
        assert [conn.adapters.get_loader(oid, Format.TEXT) for oid in oids] == before
        with pytest.raises(psycopg.DataError):
            conn.execute(far).fetchone()


def job_tasks(app: skiplock.App) -> dict[int, str]:
    with app.connect() as conn:
        rows = conn.execute(
            f"SELECT id, task FROM {SCHEMA}.jobs "
            f"UNION ALL SELECT id, task FROM {SCHEMA}.job_history"
        ).fetchall()
    return {int(row[0]): str(row[1]) for row in rows}
