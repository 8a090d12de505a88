"""The ``dashboard`` bench scenario: how long each page takes to render over a large
database (by default 1,000,000 rows of history and 100,000 live jobs).

The rows are written straight into a scratch schema (setup, not measured): history spread
over the last seven days in daily partitions, as a week's retention leaves it, in five
queues and twenty tasks, a few with errors; live jobs mostly ready, some scheduled,
retryable, running and dead. Each page is then fetched in-process through the ASGI app
(query, template and response, no network): a run's figure is the median of several
renders, in milliseconds. Run it with ``skiplock bench --scenarios dashboard`` (``--jobs``
live jobs, ``--history-rows``) or ``python -m skiplock.bench.dashboard``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.load import fresh_schema
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.config import resolve_database_url

SCHEMA = "skiplock_bench_dashboard"
DAYS = 7

# History: finished over the last DAYS days, one in a hundred cancelled, one in fifty
# after a failure, one in three tagged. Ids 1..rows (live jobs get the ids after them). The
# ten oldest are of a rare queue, task, error class and tag: a filter for them finds its
# rows at the far end.
_HISTORY_ROWS = """
INSERT INTO {history} (id, queue, task, args, state, priority, attempts, max_attempts,
                       errors, result, created_at, attempted_at, finished_at, meta)
SELECT g,
       CASE WHEN g <= 10 THEN 'rare' ELSE 'queue' || (g %% 5) END,
       CASE WHEN g <= 10 THEN 'shop.rare' ELSE 'shop.task_' || (g %% 20) END,
       jsonb_build_object('order_id', g, 'customer', 'customer-' || (g %% 1000)),
       CASE WHEN g %% 100 = 0 THEN 'cancelled' ELSE 'completed' END, 0,
       CASE WHEN g %% 50 = 0 OR g <= 10 THEN 2 ELSE 1 END, 3,
       CASE WHEN g %% 50 = 0 OR g <= 10
            THEN jsonb_build_array(jsonb_build_object(
                'attempt', 1, 'at', now(),
                'type', CASE WHEN g <= 10 THEN 'RareError' ELSE 'Error' || (g %% 7) END,
                'message', 'failed once', 'traceback', 'Traceback ...'))
            ELSE '[]'::jsonb END,
       NULL,
       t - interval '2 seconds', t - interval '1 second', t,
       CASE WHEN g <= 10 THEN jsonb_build_object('tags', jsonb_build_array('rare'))
            WHEN g %% 3 = 0 THEN jsonb_build_object('tags', jsonb_build_array('common', 'eu'))
       END
FROM (SELECT g, now() - (%(rows)s - g) * (%(days)s * interval '1 day') / %(rows)s AS t
      FROM generate_series(1, %(rows)s) AS g) AS s
"""

_LIVE_JOBS = """
INSERT INTO {jobs} (id, queue, task, args, state, run_at, attempts, max_attempts, errors,
                    worker_id, lease_expires_at, created_at, attempted_at, meta)
SELECT %(first)s + g, 'queue' || (g %% 5), 'shop.task_' || (g %% 20),
       jsonb_build_object('order_id', %(first)s + g, 'customer', 'customer-' || (g %% 1000)),
       s.state,
       CASE WHEN s.state = 'scheduled' THEN now() + interval '1 hour'
            ELSE now() - interval '1 minute' END,
       CASE WHEN s.state IN ('dead', 'retryable') THEN 3
            WHEN s.state = 'running' THEN 1 ELSE 0 END,
       3,
       CASE WHEN s.state IN ('dead', 'retryable')
            THEN jsonb_build_array(jsonb_build_object(
                'attempt', 3, 'at', now(), 'type', 'Error' || (g %% 7),
                'message', 'failed', 'traceback', 'Traceback ...'))
            ELSE '[]'::jsonb END,
       CASE WHEN s.state = 'running' THEN gen_random_uuid() END,
       CASE WHEN s.state = 'running' THEN now() + interval '1 hour' END,
       now() - interval '1 minute',
       CASE WHEN s.state IN ('running', 'dead', 'retryable') THEN now() END,
       CASE WHEN g %% 3 = 0 THEN jsonb_build_object('tags', jsonb_build_array('common', 'eu'))
       END
FROM generate_series(1, %(rows)s) AS g,
     LATERAL (SELECT CASE WHEN g %% 100 = 0 THEN 'dead'
                          WHEN g %% 100 = 1 THEN 'running'
                          WHEN g %% 100 < 5 THEN 'retryable'
                          WHEN g %% 100 < 10 THEN 'scheduled'
                          ELSE 'available' END AS state) AS s
"""


def fill(url: str, *, history_rows: int, live_jobs: int) -> None:
    """Write the rows (setup, not measured) and analyze the tables."""
    names = {
        "history": sql.Identifier(SCHEMA, "job_history"),
        "jobs": sql.Identifier(SCHEMA, "jobs"),
    }
    with psycopg.connect(url, autocommit=True) as conn:
        for day in range(DAYS + 1):
            conn.execute(
                sql.SQL("SELECT {}.history_partition_create((now() - %s * interval '1 day')::date)")
                .format(sql.Identifier(SCHEMA)),
                (day,),
            )  # fmt: skip
        conn.execute(sql.SQL(_HISTORY_ROWS).format(**names), {"rows": history_rows, "days": DAYS})
        conn.execute(
            sql.SQL(_LIVE_JOBS).format(**names), {"rows": live_jobs, "first": history_rows}
        )
        conn.execute(
            sql.SQL("SELECT setval(pg_get_serial_sequence(%s, 'id'), %s)"),
            (f"{SCHEMA}.jobs", history_rows + live_jobs + 1),
        )
        for table in names.values():
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))


def pages(history_rows: int, live_jobs: int) -> list[tuple[str, str]]:
    """(name, path) of each page measured."""
    middle = max(history_rows // 2, 1)
    return [
        ("overview", "/"),
        ("jobs", "/jobs"),
        ("jobs deep page", f"/jobs?before={middle}"),
        ("jobs dead", "/jobs?state=dead"),
        ("jobs queue+state", "/jobs?state=completed&queue=queue3"),
        ("jobs task", "/jobs?task=shop.task_7"),
        ("jobs cancelled", "/jobs?state=cancelled"),
        ("jobs error class", "/jobs?error=Error3"),
        ("jobs time range", "/jobs?from=2000-01-01T00:00&to=2000-01-02T00:00"),
        ("jobs args text", "/jobs?args=customer-77"),
        ("jobs rare queue", "/jobs?queue=rare"),
        ("jobs rare task", "/jobs?task=shop.rare"),
        ("jobs rare error", "/jobs?error=RareError"),
        ("jobs rare q+state", "/jobs?queue=rare&state=completed"),
        ("jobs tag", "/jobs?tag=common"),
        ("jobs rare tag", "/jobs?tag=rare"),
        ("job finished", f"/jobs/{middle}"),
        ("job live", f"/jobs/{history_rows + live_jobs // 2}"),
        ("cron", "/cron"),
        ("overview fragment", "/?fragment=1"),
    ]


def page_timings(
    database_url: str | None,
    *,
    history_rows: int,
    live_jobs: int,
    runs: int = 3,
    renders: int = 5,
) -> Iterator[tuple[str, list[float]]]:
    """For each page, one figure per run in milliseconds: the median of ``renders``
    renders (after one warm-up render of every page)."""
    with warnings.catch_warnings():  # Starlette's notice that its client will change
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient  # noqa: PLC0415 - the dashboard extra

    from skiplock.dashboard.web import create_app  # noqa: PLC0415

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request timed

    url = resolve_database_url(database_url, fallback_embedded=True)
    with fresh_schema(url, SCHEMA):
        fill(url, history_rows=history_rows, live_jobs=live_jobs)
        with TestClient(create_app(url, SCHEMA), base_url="http://localhost") as web:
            for name, path in pages(history_rows, live_jobs):
                response = web.get(path)
                if response.status_code != 200:
                    raise RuntimeError(f"{path} answered {response.status_code}")
                medians: list[float] = []
                for _ in range(runs):
                    times: list[float] = []
                    for _ in range(renders):
                        started = time.perf_counter()
                        web.get(path)
                        times.append((time.perf_counter() - started) * 1000)
                    medians.append(statistics.median(times))
                yield name, medians


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    timings = page_timings(s.url, history_rows=s.history_rows, live_jobs=s.jobs, runs=s.runs)
    for page, times in timings:
        report.figure(Figure(f"dashboard {page}", "ms", times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--history-rows", type=int, default=1_000_000)
    parser.add_argument("--live-jobs", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--renders", type=int, default=5, help="per run")
    args = parser.parse_args(argv)
    print(f"dashboard pages: {args.history_rows:,} history rows, {args.live_jobs:,} live jobs")
    for name, times in page_timings(
        args.database_url,
        history_rows=args.history_rows,
        live_jobs=args.live_jobs,
        runs=args.runs,
        renders=args.renders,
    ):
        summary: dict[str, Any] = {
            "median": statistics.median(times),
            "min": min(times),
            "max": max(times),
        }
        print(
            f"{name:<20} {summary['median']:>8.1f} ms  "
            f"(min {summary['min']:.1f}, max {summary['max']:.1f}, runs {len(times)})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
