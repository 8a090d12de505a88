"""The ``lowconc`` scenario: one worker process at 1, 4 and 10 slots (the default) against
the lesson's exercise-2 worker as the reference a library must beat at its own defaults,
run by run in turn, with the CPU per job of each (Python and PostgreSQL, from /proc)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.drain import drain
from skiplock.bench.measure import Cpu, CpuMeter, Figure, Report, Settings, cpu_medians

REFERENCE_SCHEMA = "skiplock_bench_reference"
# The lesson's worker after its exercise 2 (claim up to 10 jobs per transaction), with
# no-op handlers.
REFERENCE_TABLE = """
CREATE TABLE job_queue (
  id           bigserial PRIMARY KEY,
  kind         text NOT NULL,
  payload      jsonb NOT NULL DEFAULT '{}',
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int NOT NULL DEFAULT 0,
  max_attempts int NOT NULL DEFAULT 3,
  last_error   text,
  done_at      timestamptz
);
CREATE INDEX job_queue_ready ON job_queue (run_at) WHERE done_at IS NULL;
CREATE FUNCTION job_queue_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('reference_jobs', NEW.kind);
  RETURN NULL;
END $$;
CREATE TRIGGER job_queue_notify AFTER INSERT ON job_queue
  FOR EACH ROW EXECUTE FUNCTION job_queue_notify();
"""
REFERENCE_CLAIM = """
SELECT id, kind, payload, attempts FROM job_queue
WHERE done_at IS NULL AND run_at <= now() AND attempts < max_attempts
ORDER BY run_at
FOR UPDATE SKIP LOCKED
LIMIT 10"""
# The lesson finishes each job with its own UPDATE; the same worker finishing its claimed
# batch in one statement is the stronger reference, and the default one.
REFERENCE_FINISH_ONE = (
    "UPDATE job_queue SET done_at = clock_timestamp(), attempts = attempts + 1 WHERE id = %s"
)
REFERENCE_FINISH_BATCH = (
    "UPDATE job_queue SET done_at = clock_timestamp(), attempts = attempts + 1 WHERE id = ANY(%s)"
)
REFERENCE_THREADS = 4
REFERENCE_NAME = "skiplock-bench-reference"


def _reference_thread(url: str, ready: Any, stop: Any, per_job: bool) -> None:
    options = f"-c search_path={REFERENCE_SCHEMA}"
    with (
        psycopg.connect(url, options=options, application_name=REFERENCE_NAME) as conn,
        psycopg.connect(
            url, autocommit=True, options=options, application_name=REFERENCE_NAME
        ) as listen,
    ):
        listen.execute("LISTEN reference_jobs")
        ready.wait()
        while not stop.is_set():
            with conn.transaction():
                jobs = conn.execute(REFERENCE_CLAIM).fetchall()
                if per_job:
                    for job_id, _kind, _payload, _attempts in jobs:
                        conn.execute(REFERENCE_FINISH_ONE, (job_id,))
                elif jobs:
                    conn.execute(REFERENCE_FINISH_BATCH, ([job[0] for job in jobs],))
            if not jobs:
                for _ in listen.notifies(timeout=0.2, stop_after=1):
                    pass


def _reference_process(url: str, ready: Any, stop: Any, per_job: bool) -> None:
    threads = [
        threading.Thread(target=_reference_thread, args=(url, ready, stop, per_job))
        for _ in range(REFERENCE_THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def reference_once(url: str, jobs: int, *, per_job: bool = False) -> tuple[float, Cpu]:
    """The lesson's exercise-2 worker (4 threads, claim 10 per transaction, finished in
    the claiming transaction with one UPDATE, or with one per job as the lesson writes
    it) draining ``jobs`` no-op jobs, in a process of its own so its CPU is counted
    apart."""
    schema = sql.Identifier(REFERENCE_SCHEMA)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
        conn.execute(sql.SQL("SET search_path = {}").format(schema))
        conn.execute(REFERENCE_TABLE)
        context = multiprocessing.get_context("spawn")
        ready, stop = context.Barrier(REFERENCE_THREADS + 1), context.Event()
        child = context.Process(target=_reference_process, args=(url, ready, stop, per_job))
        child.start()
        try:
            ready.wait(timeout=60)
            assert child.pid is not None
            meter = CpuMeter(conn, [child.pid], REFERENCE_NAME)
            conn.execute(
                "INSERT INTO job_queue (kind) SELECT 'noop' FROM generate_series(1, %s)",
                (jobs,),
            )
            started = conn.execute("SELECT now()").fetchone()
            assert started is not None
            deadline = time.monotonic() + 600
            while conn.execute(
                "SELECT EXISTS (SELECT 1 FROM job_queue WHERE done_at IS NULL)"
            ).fetchone() != (False,):
                if time.monotonic() > deadline or child.exitcode is not None:
                    raise RuntimeError("the reference worker did not drain its jobs")
                time.sleep(0.02)
            cpu = meter.per_job(jobs)
            row = conn.execute(
                "SELECT extract(epoch FROM max(done_at) - %s)::float8 FROM job_queue",
                (started[0],),
            ).fetchone()
            assert row is not None
            return jobs / float(row[0]), cpu
        finally:
            stop.set()
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))


LOW_SLOTS = (1, 4, 10)


def low_concurrency(url: str, schema: str, jobs: int, runs: int) -> list[Figure]:
    """One worker process at 1, 4 and 10 slots (the default) against the lesson's worker
    finishing each claimed batch with one UPDATE (``vs_reference``) and each job with its
    own (``vs_reference_per_job``), interleaved run by run so that drift of a noisy
    machine hits all alike."""
    reference = Figure("lowconc reference (lesson, batch UPDATE)", "jobs/s")
    per_job = Figure("lowconc reference (lesson, per-job UPDATE)", "jobs/s")
    mine = {n: Figure(f"lowconc 1x{n}", "jobs/s") for n in LOW_SLOTS}
    figures = [reference, per_job, *mine.values()]
    cpu: dict[str, list[Cpu]] = {f.name: [] for f in figures}
    for _ in range(runs):
        for figure in (reference, per_job):
            rate, used = reference_once(url, jobs, per_job=figure is per_job)
            figure.runs.append(rate)
            cpu[figure.name].append(used)
        for slots, figure in mine.items():
            rate, used = drain(url, schema, jobs, 1, slots)
            figure.runs.append(rate)
            cpu[figure.name].append(used)
    for figure in figures:
        figure.extra["jobs"] = jobs
        figure.extra.update(cpu_medians(cpu[figure.name]))
    for figure in mine.values():
        figure.extra["vs_reference"] = round(figure.median / reference.median, 2)
        figure.extra["vs_reference_per_job"] = round(figure.median / per_job.median, 2)
    return figures


def scenario(name: str, settings: Settings, report: Report) -> None:
    report.figure(*low_concurrency(settings.url, settings.schema, settings.jobs, settings.runs))
