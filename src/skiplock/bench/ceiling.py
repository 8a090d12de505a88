"""The ``ceiling`` scenario: the worker's own claim and completion statements in tight
loops from a few client processes, with nothing of the worker between them (the
database's limit for this batch size), the same as raw SQL under pgbench when there is
one, and in each run the drain they bound, with its share of each."""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock.bench.drain import drain
from skiplock.bench.load import copy_jobs, fresh_schema
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.pgbench import pgbench_path, run_pgbench
from skiplock.bench.workers import WORKER_ARGS
from skiplock.completer import outcome_writes
from skiplock.config import results_notice
from skiplock.cursor import ClaimCursor
from skiplock.outcomes import Completed
from skiplock.sql import claim, complete, render
from skiplock.worker import WorkerOptions


def worker_claim_batch(concurrency: int) -> int:
    """The most a worker with ``concurrency`` slots claims at once: the default batch_max
    of WorkerOptions (read from there, so the two cannot drift apart), since by default
    it claims short jobs ahead of its free slots up to that (decision 018); with fewer
    slots and no claim-ahead (--prefetch 0) it would be its free slots."""
    batch_max = WorkerOptions().batch_max
    pairs = list(itertools.pairwise(WORKER_ARGS))
    if ("--prefetch", "0") in pairs or "--prefetch=0" in WORKER_ARGS:
        return max(1, min(concurrency, batch_max))
    return batch_max


# Clients of the ceiling, as pgbench was run for the design's reference figures.
CEILING_CLIENTS = 4


def _ceiling_claim(
    conn: psycopg.Connection[Any],
    schema: str,
    worker_id: uuid.UUID,
    batch: int,
    cursor: ClaimCursor,
) -> list[tuple[Any, ...]] | None:
    """The worker's claim of up to ``batch`` jobs, resumed from ``cursor`` as the worker's
    is, and the cursor moved past them; None when a claim from the start of the queue
    found nothing (the queue is drained). Alone here so that a change of the claim's
    parameters (sql/claim.py) is one edit."""
    while True:
        params: dict[str, Any] = {
            "queue": "default",
            "exclude_tasks": [],
            "limit": batch,
            "worker_id": worker_id,
            "lease_seconds": 30,
            "governed": False,  # as the worker claims a queue without limits
        }
        after = cursor.start()
        if after is not None:
            params.update(after_priority=after[0], after_run_at=after[1], after_id=after[2])
        statement = claim.JOB_CLAIM_BATCH if after is None else claim.JOB_CLAIM_BATCH_AFTER
        rows = conn.execute(render(statement, schema), params).fetchall()
        if rows:
            # Columns 4, 5 and 0 are priority, run_at and id: the claim order.
            cursor.advance([(row[4], row[5], row[0]) for row in rows])
            return rows
        if after is None:
            return None
        # Jobs another client held when this one passed them: sweep once more.
        cursor.force_sweep()


def _ceiling_process(url: str, schema: str, batch: int, start: Any, result: Any) -> None:
    """One client: the worker's claim, then its completer's flush of that batch, in a
    loop, on a connection with the worker's session options. Ends when a claim from the
    start of the queue finds nothing."""
    worker_id = uuid.uuid4()
    complete_sql = render(complete.JOB_COMPLETE_MANY_IF_LEASED, schema)
    durable_sql = render(complete.DURABLE_COMMIT_ON, schema)
    notice = results_notice(schema)
    cursor = ClaimCursor()
    done = 0
    with psycopg.connect(url, autocommit=True, options=claim.WORKER_SESSION_OPTIONS) as conn:
        start.wait()
        while (rows := _ceiling_claim(conn, schema, worker_id, batch, cursor)) is not None:
            # Column 6 is the attempt (the fencing token); a no-op handler returns None.
            outcomes = [Completed(row[0], row[6]) for row in rows]
            with conn.transaction():
                conn.execute(durable_sql)
                for group, written in outcome_writes(outcomes):
                    assert group == "completed", group
                    conn.execute(complete_sql, {**written, "worker_id": worker_id})
                conn.execute(*notice)
            done += len(rows)
    result.put(done)


def ceiling_once(url: str, schema: str, jobs: int, batch: int) -> float:
    """The worker's claim and completion SQL in tight loops, with nothing of the worker
    between them: the database's own limit here."""
    with fresh_schema(url, schema), psycopg.connect(url, autocommit=True) as conn:
        copy_jobs(conn, schema, "bench.noop", jobs)
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "jobs")))
        # spawn, not fork: the arguments (the URL among them) travel through a pipe, and
        # the children's command lines carry no password.
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        clients = CEILING_CLIENTS
        start = context.Barrier(clients + 1)
        children = [
            context.Process(target=_ceiling_process, args=(url, schema, batch, start, results))
            for _ in range(clients)
        ]
        for child in children:
            child.start()
        try:
            start.wait(timeout=60)  # every client connected: time the work, not start-up
        except threading.BrokenBarrierError:
            raise RuntimeError(
                "a ceiling client process did not connect (its traceback is above)"
            ) from None
        started = time.perf_counter()
        total = 0
        for _ in children:
            while True:
                try:
                    total += results.get(timeout=1)
                    break
                except queue.Empty:
                    failed = [c.exitcode for c in children if c.exitcode not in (None, 0)]
                    if failed:
                        raise RuntimeError(
                            f"a ceiling client process failed (exit code {failed[0]}; "
                            "its traceback is above)"
                        ) from None
        elapsed = time.perf_counter() - started
        for child in children:
            child.join()
        assert total == jobs, (total, jobs)
        return jobs / elapsed


# The raw-SQL ceiling: what the design's reference figures ran under pgbench, each
# transaction claiming a batch with SKIP LOCKED and moving it to history in one statement.
RAW_CEILING_SCRIPT = """
WITH picked AS (
    SELECT id FROM {jobs}
    WHERE queue = 'default' AND state = 'available' AND run_at <= now()
    ORDER BY priority, run_at, id
    LIMIT {batch}
    FOR UPDATE SKIP LOCKED
), done AS (
    DELETE FROM {jobs} WHERE id IN (SELECT id FROM picked) RETURNING *
)
INSERT INTO {history} (id, queue, task, args, state, priority, attempts, max_attempts,
                       errors, created_at, attempted_at)
SELECT id, queue, task, args, 'completed', priority, attempts + 1, max_attempts, errors,
       created_at, now()
FROM done;
"""


def raw_ceiling_once(url: str, schema: str, jobs: int, batch: int, binary: Path) -> float:
    """Jobs per second that CEILING_CLIENTS pgbench connections move to history with
    RAW_CEILING_SCRIPT, a batch per transaction, until the queue is empty (on pgbench's
    clock, connections excluded)."""
    with fresh_schema(url, schema), psycopg.connect(url, autocommit=True) as conn:
        copy_jobs(conn, schema, "bench.noop", jobs)
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "jobs")))
        script = (
            sql.SQL(" ".join(RAW_CEILING_SCRIPT.split()))
            .format(
                jobs=sql.Identifier(schema, "jobs"),
                history=sql.Identifier(schema, "job_history"),
                batch=sql.Literal(batch),
            )
            .as_string(conn)
        )
        per_client = -(-jobs // (CEILING_CLIENTS * batch))
        done = run_pgbench(
            binary, url, script + "\n", clients=CEILING_CLIENTS, transactions=per_client
        )
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "job_history"))
        ).fetchone()
        assert row is not None
        return int(row[0]) / done.seconds


def ceiling_figures(
    url: str, schema: str, jobs: int, processes: int, concurrency: int, runs: int
) -> list[Figure]:
    """The ceiling and the drain it bounds, like for like: the same jobs, the worker's
    own batch and statements (and, with pgbench here, the raw-SQL ceiling at that batch),
    measured in turn in each run, the drain's share of each from the same run."""
    batch = worker_claim_batch(concurrency)
    binary = pgbench_path()
    shape = {"batch": batch, "clients": CEILING_CLIENTS}
    ceiling = Figure("ceiling (SQL only)", "jobs/s", extra=dict(shape))
    raw = Figure("ceiling (raw SQL, pgbench)", "jobs/s", extra=dict(shape))
    drained = Figure(f"ceiling: drain {processes}x{concurrency}", "jobs/s")
    for _ in range(runs):
        ceiling.runs.append(ceiling_once(url, schema, jobs, batch))
        if binary is not None:
            raw.runs.append(raw_ceiling_once(url, schema, jobs, batch, binary))
        drained.runs.append(drain(url, schema, jobs, processes, concurrency).rate)
    drained.extra["vs_ceiling"] = round(drained.median / ceiling.median, 2)
    ceiling.extra["drain_share"] = drained.extra["vs_ceiling"]
    figures = [ceiling]
    if raw.runs:
        drained.extra["vs_raw_ceiling"] = round(drained.median / raw.median, 2)
        raw.extra["drain_share"] = drained.extra["vs_raw_ceiling"]
        figures.append(raw)
    return [*figures, drained]


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    report.figure(*ceiling_figures(s.url, s.schema, s.jobs, s.processes, s.concurrency, s.runs))
