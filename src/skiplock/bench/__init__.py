"""``skiplock bench``: throughput and latency scenarios, each the median of several runs.

Workers run as real ``skiplock worker`` processes over this module's ``app``; the figures
are taken from the database (commit times, ``finished_at``) so that polling by the bench
itself does not blur them. Every scenario runs in its own schema (enqueue-concurrent in
two, one of them without the insert triggers), dropped afterwards. The scenarios of the
application's commit path and wake-ups live in bench/commit.py.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import multiprocessing
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.bench.pgbench import pgbench_path, run_pgbench
from skiplock.bench.topology import Network, postgres_bin
from skiplock.completer import Outcome, outcome_writes
from skiplock.config import DATABASE_URL_ENV, SCHEMA_ENV, done_channel, resolve_database_url
from skiplock.cursor import ClaimCursor
from skiplock.sql import claim, complete, render

BENCH_SCHEMA = "skiplock_bench"
# Scenarios on servers the bench builds itself, on hosts of its own (bench/hosts.py).
OWN_SERVERS = ("hosts", "failover")
# The application's commit path and wake-ups (bench/commit.py).
COMMIT_SCENARIOS = ("enqueue-concurrent", "wakeup", "latency", "late-commit")
REFERENCE_SCHEMA = "skiplock_bench_reference"
# Extra arguments for every bench worker process (``bench --worker-args``), for A/B runs
# of a setting; empty means the worker's defaults.
WORKER_ARGS: list[str] = []

# The app the worker processes run: no-op and probe handlers.
app = App(schema=os.environ.get(SCHEMA_ENV, BENCH_SCHEMA))


@app.task(name="bench.noop")
async def noop() -> None:
    return None


@app.task(name="bench.pause")
async def pause(ms: int) -> None:
    """A short job: the failover scenario's drain must still run when the primary goes."""
    await asyncio.sleep(ms / 1000)


@app.task(name="bench.probe")
async def probe() -> float:
    """Returns when it started, so latency is computed from the stored result."""
    return time.time()


@dataclass
class Figure:
    """One scenario's result over several runs."""

    name: str
    unit: str
    runs: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "unit": self.unit,
            "median": round(self.median, 3),
            "min": round(min(self.runs), 3),
            "max": round(max(self.runs), 3),
            "runs": [round(r, 3) for r in self.runs],
            **self.extra,
        }

    def line(self) -> str:
        text = (
            f"{self.name:<40} {self.median:>12,.1f} {self.unit:<8} "
            f"(min {min(self.runs):,.1f}, max {max(self.runs):,.1f}, runs {len(self.runs)})"
        )
        if self.extra:
            text += "  " + ", ".join(f"{k}={v}" for k, v in self.extra.items())
        return text


@contextmanager
def fresh_schema(url: str, schema: str) -> Iterator[App]:
    bench_app = App(url, schema=schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    bench_app.migrate()
    try:
        yield bench_app
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def copy_jobs(
    conn: psycopg.Connection[Any],
    schema: str,
    task: str,
    count: int,
    *,
    state: str = "available",
    run_at: str = "now()",
) -> None:
    """Insert ``count`` argument-less jobs in one statement (setup, not measured)."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (task, args, state, run_at) "
            "SELECT %s, '{{}}'::jsonb, %s, " + run_at + " FROM generate_series(1, %s)"
        ).format(sql.Identifier(schema, "jobs")),
        (task, state, count),
    )


# The job features a drain can be run with: each job's unique key, ordering key and key
# limit as SQL over the series number i (setup, not measured).
FEATURES = {
    "unique": ("'u' || i", "NULL", "1"),
    # Chains of ten: 10,000 keys for 100,000 jobs, each key's jobs one at a time in order.
    "ordered": ("NULL", "'o' || (i %% greatest(%(jobs)s / 10, 1))", "1"),
    # 1,000 customers, at most 3 jobs of each running at once.
    "keylimit": ("NULL", "'c' || (i %% 1000)", "3"),
}


def feature_jobs(conn: psycopg.Connection[Any], schema: str, feature: str, count: int) -> None:
    """Insert ``count`` no-op jobs using ``feature`` in one statement. Keyed jobs go in
    as 'blocked', exactly as enqueue writes them; the leader admits them."""
    unique, ordering, limit = FEATURES[feature]
    state = "available" if ordering == "NULL" else "blocked"
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (task, args, state, unique_key, ordering_key, key_limit) "
            f"SELECT 'bench.noop', '{{{{}}}}'::jsonb, %(state)s, {unique}, {ordering}, {limit} "
            "FROM generate_series(1, %(jobs)s) AS i"
        ).format(sql.Identifier(schema, "jobs")),
        {"state": state, "jobs": count},
    )


@dataclass(frozen=True)
class Placement:
    """Bench workers on hosts of a topology (skiplock.bench.topology): ``processes`` on each of
    ``hosts``, reaching the server at ``url`` across the topology's bridge."""

    network: Network
    hosts: tuple[str, ...]
    url: str


@contextmanager
def worker_processes(
    url: str,
    schema: str,
    processes: int,
    concurrency: int,
    extra_args: Sequence[str] = (),
    *,
    placement: Placement | None = None,
    logs: Path | None = None,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start ``processes`` worker processes (on each host of ``placement``, if given) and
    wait until each has registered; with ``logs``, each one's output goes to a file there.
    The URL goes in their environment: a command line is readable by every user of the
    machine."""
    worker_url = url if placement is None else placement.url
    env = {**os.environ, DATABASE_URL_ENV: worker_url, SCHEMA_ENV: schema}
    command = [
        sys.executable,
        "-m",
        "skiplock",
        "--schema",
        schema,
        "worker",
        "skiplock.bench:app",
        "--concurrency",
        str(concurrency),
        "--poll-interval",
        "0.5",
        *extra_args,
        *WORKER_ARGS,
    ]
    commands = (
        [command] * processes
        if placement is None
        else [
            placement.network.run_in(h, command) for h in placement.hosts for _ in range(processes)
        ]
    )
    children = []
    for index, argv in enumerate(commands):
        out: Any = subprocess.DEVNULL
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            out = (logs / f"worker-{index}.log").open("wb")
        try:
            children.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
        finally:
            if logs is not None:
                out.close()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "workers"))
            while True:
                row = conn.execute(query).fetchone()
                if row is not None and row[0] >= len(children):
                    break
                if time.monotonic() > deadline or any(c.poll() is not None for c in children):
                    raise RuntimeError("bench worker processes did not start")
                time.sleep(0.05)
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _wait_drained(conn: psycopg.Connection[Any], schema: str, timeout: float) -> None:
    # Drained: nothing left to run now (the `scheduled` scenario's far-future jobs stay).
    query = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {} "
        "WHERE state IN ('blocked', 'available', 'running', 'retryable'))"
    ).format(sql.Identifier(schema, "jobs"))
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query).fetchone()
        if row is not None and not row[0]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs did not drain within {timeout}s")
        time.sleep(0.02)


def _drain_seconds(conn: psycopg.Connection[Any], schema: str, started: Any) -> float:
    row = conn.execute(
        sql.SQL("SELECT extract(epoch FROM max(finished_at) - %s)::float8 FROM {}").format(
            sql.Identifier(schema, "job_history")
        ),
        (started,),
    ).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0])


def drain_once(
    url: str,
    schema: str,
    jobs: int,
    processes: int,
    concurrency: int,
    setup: Callable[[psycopg.Connection[Any]], None] | None = None,
    feature: str | None = None,
    placement: Placement | None = None,
) -> float:
    """Jobs per second for ``jobs`` no-op jobs committed at once, workers already idle;
    with ``feature``, every job uses it (FEATURES); with ``placement``, the workers run
    on hosts of a topology."""
    return drain_measured(url, schema, jobs, processes, concurrency, setup, feature, placement)[0]


def drain_measured(
    url: str,
    schema: str,
    jobs: int,
    processes: int,
    concurrency: int,
    setup: Callable[[psycopg.Connection[Any]], None] | None = None,
    feature: str | None = None,
    placement: Placement | None = None,
) -> tuple[float, Cpu]:
    """``drain_once``, with the CPU the drain cost per job: the worker processes' and
    that of the PostgreSQL backends serving them."""
    with fresh_schema(url, schema), psycopg.connect(url, autocommit=True) as conn:
        if setup is not None:
            setup(conn)
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "jobs")))
        with worker_processes(url, schema, processes, concurrency, placement=placement) as children:
            meter = CpuMeter(conn, [c.pid for c in children], "skiplock %")
            with conn.transaction():
                if feature is None:
                    copy_jobs(conn, schema, "bench.noop", jobs)
                else:
                    feature_jobs(conn, schema, feature, jobs)
            started = conn.execute("SELECT now()").fetchone()
            assert started is not None
            # now() above is after the commit: a slight underestimate of the drain time is
            # impossible, the commit is earlier still.
            _wait_drained(conn, schema, timeout=600)
            cpu = meter.per_job(jobs)
            return jobs / _drain_seconds(conn, schema, started[0]), cpu


@dataclass(frozen=True)
class Cpu:
    """CPU microseconds per job: the client processes' (Python), and the PostgreSQL
    backends' serving them; None where it could not be read (a server on another host)."""

    python_us: float | None
    postgres_us: float | None


def _proc_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU of a process (all its threads) from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used from now until ``per_job`` by some client processes and by the backends
    whose application_name matches ``backends`` (a LIKE pattern). Backends are read from
    /proc, so only for a server on this machine; new backends count from zero."""

    def __init__(
        self, conn: psycopg.Connection[Any], clients: Sequence[int], backends: str
    ) -> None:
        self._conn = conn
        self._clients = list(clients)
        self._pattern = backends
        self._start_clients = self._client_seconds()
        self._start_backends = self._backend_seconds()

    def _client_seconds(self) -> float | None:
        total = 0.0
        for pid in self._clients:
            seconds = _proc_cpu_seconds(pid)
            if seconds is None:
                return None
            total += seconds
        return total

    def _backend_seconds(self) -> dict[int, float] | None:
        rows = self._conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE %s",
            (self._pattern,),
        ).fetchall()
        found: dict[int, float] = {}
        for (pid,) in rows:
            seconds = _proc_cpu_seconds(pid)
            if seconds is None:
                return None  # not a process of this machine
            found[pid] = seconds
        return found

    def per_job(self, jobs: int) -> Cpu:
        clients, backends = self._client_seconds(), self._backend_seconds()
        python_us = postgres_us = None
        if clients is not None and self._start_clients is not None:
            python_us = (clients - self._start_clients) * 1e6 / jobs
        if backends is not None and self._start_backends is not None:
            used = sum(s - self._start_backends.get(pid, 0.0) for pid, s in backends.items())
            postgres_us = used * 1e6 / jobs
        return Cpu(python_us, postgres_us)


# The lesson's worker after its exercise 2 (claim up to 10 jobs per transaction), with
# no-op handlers: the reference a library must beat at its own defaults.
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
# batch in one statement is the stronger reference (issue 21), and the default one.
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


def _set_insert_triggers(conn: psycopg.Connection[Any], schema: str, enabled: bool) -> None:
    """Enable or disable the jobs table's insert triggers (the wake-up notification)."""
    names = conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass "
        "AND NOT tgisinternal AND tgtype & 4 <> 0",  # TRIGGER_TYPE_INSERT
        (f"{schema}.jobs",),
    ).fetchall()
    action = sql.SQL("ENABLE" if enabled else "DISABLE")
    for (name,) in names:
        conn.execute(
            sql.SQL("ALTER TABLE {} {} TRIGGER {}").format(
                sql.Identifier(schema, "jobs"), action, sql.Identifier(name)
            )
        )


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
            rate, used = drain_measured(url, schema, jobs, 1, slots)
            figure.runs.append(rate)
            cpu[figure.name].append(used)
    for figure in figures:
        figure.extra["jobs"] = jobs
        figure.extra.update(_cpu_medians(cpu[figure.name]))
    for figure in mine.values():
        figure.extra["vs_reference"] = round(figure.median / reference.median, 2)
        figure.extra["vs_reference_per_job"] = round(figure.median / per_job.median, 2)
    return figures


def _cpu_medians(samples: Sequence[Cpu]) -> dict[str, float | None]:
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 1) if known else None

    return {
        "py_cpu_us_per_job": median([c.python_us for c in samples]),
        "pg_cpu_us_per_job": median([c.postgres_us for c in samples]),
    }


def enqueue_once(url: str, schema: str, jobs: int) -> float:
    """Jobs per second through ``App.enqueue_many``, building the jobs included."""
    with fresh_schema(url, schema) as bench_app, psycopg.connect(url) as conn:
        task = bench_app.tasks.get("bench.noop") or bench_app.task(name="bench.noop")(noop.fn)
        started = time.perf_counter()
        bench_app.enqueue_many(conn, [task.job() for _ in range(jobs)])
        conn.commit()
        return jobs / (time.perf_counter() - started)


def worker_claim_batch(concurrency: int) -> int:
    """The most a worker with ``concurrency`` slots claims at once: ``Worker``'s batch_max
    (read from its signature, so the two cannot drift apart), since by default it claims
    short jobs ahead of its free slots up to that (decision 018); with fewer slots and no
    claim-ahead (--prefetch 0) it would be its free slots."""
    from skiplock.worker import Worker  # noqa: PLC0415 - the worker processes import it anyway

    batch_max = int(inspect.signature(Worker).parameters["batch_max"].default)
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
    done_sql = render(complete.JOBS_DONE_NOTIFY, schema)
    channel = done_channel(schema)
    cursor = ClaimCursor()
    done = 0
    with psycopg.connect(url, autocommit=True, options=claim.WORKER_SESSION_OPTIONS) as conn:
        start.wait()
        while (rows := _ceiling_claim(conn, schema, worker_id, batch, cursor)) is not None:
            # Column 6 is the attempt (the fencing token); a no-op handler returns None.
            outcomes = [Outcome(row[0], row[6], result_json=None) for row in rows]
            with conn.transaction():
                conn.execute(durable_sql)
                for group, written in outcome_writes(outcomes):
                    assert group == "completed", group
                    conn.execute(complete_sql, {**written, "worker_id": worker_id})
                conn.execute(done_sql, {"channel": channel})
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
    drain = Figure(f"ceiling: drain {processes}x{concurrency}", "jobs/s")
    for _ in range(runs):
        ceiling.runs.append(ceiling_once(url, schema, jobs, batch))
        if binary is not None:
            raw.runs.append(raw_ceiling_once(url, schema, jobs, batch, binary))
        drain.runs.append(drain_once(url, schema, jobs, processes, concurrency))
    drain.extra["vs_ceiling"] = round(drain.median / ceiling.median, 2)
    ceiling.extra["drain_share"] = drain.extra["vs_ceiling"]
    figures = [ceiling]
    if raw.runs:
        drain.extra["vs_raw_ceiling"] = round(drain.median / raw.median, 2)
        raw.extra["drain_share"] = drain.extra["vs_raw_ceiling"]
        figures.append(raw)
    return [*figures, drain]


def seed_once(url: str, prefetch: str = "auto") -> float:
    """The lesson's 400-job scenario, via ``skiplock demo --json``."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "skiplock",
            "demo",
            "--json",
            "--prefetch",
            prefetch,
        ],
        env={**os.environ, DATABASE_URL_ENV: url},  # not on the command line
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(json.loads(out)["drain_seconds"])


def history_setup(kind: str, rows: int) -> Callable[[psycopg.Connection[Any]], None]:
    def setup(conn: psycopg.Connection[Any]) -> None:
        schema = BENCH_SCHEMA
        if kind == "finished":
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (id, queue, task, args, state, priority, attempts, "
                    "max_attempts, errors, created_at, attempted_at, finished_at) "
                    "SELECT -g, 'default', 'bench.noop', '{{}}', 'completed', 0, 1, 3, '[]', "
                    "now() - interval '1 day', now() - interval '1 day', "
                    "now() - interval '1 day' FROM generate_series(1, %s) AS g"
                ).format(sql.Identifier(schema, "job_history")),
                (rows,),
            )
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "job_history")))
        else:
            copy_jobs(
                conn,
                schema,
                "bench.noop",
                rows,
                state="scheduled",
                run_at="now() + interval '1 day'",
            )

    return setup


def run(
    scenarios: Sequence[str],
    *,
    database_url: str | None,
    jobs: int,
    processes: int,
    concurrency: int,
    runs: int,
    history_rows: int,
    as_json: bool,
    rate: int = 1000,
    phase_seconds: Sequence[float] = (20, 60, 180, 60),
    enqueue_seconds: float = 20.0,
    clients: Sequence[int] = (8, 32, 64),
    samples: int = 200,
    worker_args: Sequence[str] = (),
    promote_after: float = 0.0,
) -> int:
    schema = BENCH_SCHEMA
    WORKER_ARGS[:] = worker_args
    figures: list[Figure] = []

    def report(figure: Figure) -> None:
        figures.append(figure)
        if not as_json:
            print(figure.line(), flush=True)

    # The hosts and failover scenarios build servers of their own; the others measure
    # --database-url, or with nothing configured the embedded server (as demo runs on it).
    own_servers = set(scenarios) <= set(OWN_SERVERS)
    url = "" if own_servers else resolve_database_url(database_url, fallback_embedded=True)
    version, fsync = "?", "on"
    if url:
        with psycopg.connect(url) as conn:
            settings = conn.execute(
                "SELECT current_setting('server_version'), current_setting('fsync')"
            ).fetchone()
            version, fsync = settings or ("?", "?")
    else:
        version = own_server_version()
    meta = {
        "server_version": version,
        "fsync": fsync,
        "cpus": os.cpu_count(),
        "jobs": jobs,
        "processes": processes,
        "concurrency": concurrency,
    }
    if not as_json:
        print(
            f"skiplock bench: PostgreSQL {meta['server_version']}, fsync={meta['fsync']}, "
            f"{meta['cpus']} CPUs; {jobs:,} jobs, {processes} worker processes x "
            f"{concurrency}; median of {runs} runs",
            flush=True,
        )
    drain_median: float | None = None
    pressure_runs: list[list[dict[str, Any]]] = []
    for scenario in scenarios:
        if scenario in OWN_SERVERS:
            from skiplock.bench import hosts  # noqa: PLC0415 - needs root; builds servers

            if scenario == "hosts":
                built = hosts.hosts_figures(jobs, processes, concurrency, runs)
            else:
                built = hosts.failover_figures(
                    jobs, processes, concurrency, runs, rate, promote_after
                )
            for figure in built:
                report(figure)
            continue
        if scenario == "enqueue":
            fig = Figure("enqueue (enqueue_many)", "jobs/s")
            fig.runs = [enqueue_once(url, schema, jobs) for _ in range(runs)]
        elif scenario == "lowconc":
            for figure in low_concurrency(url, schema, jobs, runs):
                report(figure)
            continue
        elif scenario in COMMIT_SCENARIOS:
            from skiplock.bench import commit  # noqa: PLC0415 - imports this module

            if scenario == "enqueue-concurrent":
                built = commit.enqueue_concurrent(url, enqueue_seconds, runs, clients)
            elif scenario == "wakeup":
                built = commit.wakeup(url, schema, runs, samples=samples)
            elif scenario == "latency":
                # The wake-up through Task.enqueue, under the figures' old names.
                built = commit.wakeup(
                    url,
                    schema,
                    runs,
                    paths=[commit.PATH_ENQUEUE],
                    samples=samples,
                    name=lambda _path, pct: f"latency {pct}",
                )
            else:
                built = commit.late_commit(url, schema, rate, enqueue_seconds, runs)
            for figure in built:
                report(figure)
            continue
        elif scenario == "drain":
            fig = Figure("drain", "jobs/s")
            fig.runs = [drain_once(url, schema, jobs, processes, concurrency) for _ in range(runs)]
            drain_median = fig.median
        elif scenario in FEATURES:
            fig = Figure(f"drain, {scenario} jobs", "jobs/s")
            fig.runs = [
                drain_once(url, schema, jobs, processes, concurrency, feature=scenario)
                for _ in range(runs)
            ]
            if drain_median is not None:
                fig.extra["vs_drain"] = round(fig.median / drain_median, 2)
        elif scenario == "ceiling":
            for figure in ceiling_figures(url, schema, jobs, processes, concurrency, runs):
                report(figure)
            continue
        elif scenario == "seed":
            fig = Figure("seed (lesson's 400 jobs)", "s", [seed_once(url) for _ in range(runs)])
            report(fig)
            # The same with nothing claimed ahead (--prefetch 0), as the lesson's workers.
            fig = Figure("seed, prefetch 0", "s", [seed_once(url, "0") for _ in range(runs)])
        elif scenario in ("history", "scheduled"):
            kind = "finished" if scenario == "history" else "scheduled"
            fig = Figure(f"drain, {history_rows:,} {kind} rows", "jobs/s")
            fig.runs = [
                drain_once(
                    url,
                    schema,
                    jobs,
                    processes,
                    concurrency,
                    setup=history_setup(kind, history_rows),
                )
                for _ in range(runs)
            ]
            if drain_median is not None:
                fig.extra["vs_drain"] = round(fig.median / drain_median, 2)
        elif scenario == "dashboard":
            # Median render time of each dashboard page: --jobs live jobs, --history-rows.
            from skiplock.dashboard import bench as dashboard_bench  # noqa: PLC0415

            for name, times in dashboard_bench.page_timings(
                url, history_rows=history_rows, live_jobs=jobs, runs=runs
            ):
                report(Figure(f"dashboard {name}", "ms", times))
            continue
        elif scenario == "pressure":
            names = ("warm-up", "clean", "held", "recovery")
            phases = [
                Phase(name, seconds, hold=name == "held")
                for name, seconds in zip(names, phase_seconds, strict=False)
            ]
            for _ in range(runs):
                rows = pressure_once(
                    url,
                    schema,
                    rate=rate,
                    phases=phases,
                    processes=processes,
                    concurrency=concurrency,
                )
                pressure_runs.append(rows)
                if not as_json:
                    for row in rows:
                        print(
                            "pressure " + ", ".join(f"{k}={v}" for k, v in row.items()),
                            flush=True,
                        )
            continue
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        report(fig)
    if as_json:
        print(
            json.dumps(
                {
                    "meta": meta,
                    "figures": [f.as_dict() for f in figures],
                    "pressure": pressure_runs,
                }
            )
        )
    return 0


def own_server_version() -> str:
    """The version of the binaries the hosts and failover scenarios run (``postgres -V``)."""
    binaries = postgres_bin()
    if binaries is None:
        return "?"
    try:
        done = subprocess.run(
            [str(binaries / "postgres"), "-V"], capture_output=True, text=True, check=False
        )
    except OSError:
        return "?"  # the scenario's own check says what is missing
    found = re.search(r"\d+(?:\.\d+)+", done.stdout)
    return found.group(0) if done.returncode == 0 and found else "?"


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    hold: bool = False


def _postgres_cpu_seconds() -> float | None:
    """CPU time used so far by every PostgreSQL server process on this machine; None
    without psutil (it comes with the embedded extra)."""
    try:
        import psutil  # noqa: PLC0415 - optional
    except ImportError:
        return None

    total = 0.0
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in ("postgres", "postmaster"):
            try:
                times = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += times.user + times.system
    return total


def _jobs_stats(conn: psycopg.Connection[Any], schema: str) -> tuple[int, int]:
    """Index tuples read on the jobs table so far, and its dead tuples now."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes"
        "        WHERE schemaname = %(s)s AND relname = 'jobs'),"
        "       (SELECT n_dead_tup FROM pg_stat_user_tables"
        "        WHERE schemaname = %(s)s AND relname = 'jobs')",
        {"s": schema},
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1] or 0)


def pressure_once(
    url: str,
    schema: str,
    *,
    rate: int,
    phases: Sequence[Phase],
    processes: int,
    concurrency: int,
) -> list[dict[str, Any]]:
    """Offer ``rate`` jobs/s in batches every 50 ms through the phases; one phase holds a
    transaction open (idle, with an xid) so VACUUM can remove nothing."""
    tick = 0.05
    with (
        fresh_schema(url, schema) as bench_app,
        worker_processes(url, schema, processes, concurrency),
        psycopg.connect(url, autocommit=True) as stats_conn,
        psycopg.connect(url) as producer,
        psycopg.connect(url) as holder,
    ):
        task = bench_app.task(name="bench.probe")(probe.fn)
        committed: dict[int, float] = {}
        stop = threading.Event()

        def produce() -> None:
            per_tick = max(1, round(rate * tick))
            next_at = time.monotonic()
            carry = 0.0
            while not stop.is_set():
                carry += rate * tick - per_tick
                extra = int(carry)
                carry -= extra
                ids = bench_app.enqueue_many(
                    producer, [task.job() for _ in range(per_tick + extra)]
                )
                producer.commit()
                now = time.time()
                for job_id in ids:
                    committed[job_id] = now
                next_at += tick
                time.sleep(max(0.0, next_at - time.monotonic()))

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        boundaries: list[dict[str, Any]] = []
        try:
            for phase in phases:
                if phase.hold:
                    holder.execute("SELECT txid_current()")  # now idle in transaction
                tuples, _ = _jobs_stats(stats_conn, schema)
                start = {"t": time.time(), "cpu": _postgres_cpu_seconds(), "tuples": tuples}
                time.sleep(phase.seconds)
                tuples, dead = _jobs_stats(stats_conn, schema)
                end = {"t": time.time(), "cpu": _postgres_cpu_seconds(), "tuples": tuples}
                if phase.hold:
                    holder.rollback()
                boundaries.append({"phase": phase, "start": start, "end": end, "dead": dead})
        finally:
            stop.set()
            thread.join()
        _wait_drained(stats_conn, schema, timeout=600)
        started: dict[int, float] = dict(
            stats_conn.execute(
                sql.SQL("SELECT id, result::float8 FROM {}").format(
                    sql.Identifier(schema, "job_history")
                )
            ).fetchall()
        )
    return [_phase_figures(b, committed, started) for b in boundaries]


def _phase_figures(
    boundary: dict[str, Any], committed: dict[int, float], started: dict[int, float]
) -> dict[str, Any]:
    t0, t1 = boundary["start"]["t"], boundary["end"]["t"]
    offered = [i for i, at in committed.items() if t0 <= at < t1]
    waits = sorted((started[i] - committed[i]) * 1000 for i in offered if i in started)
    ran = sum(1 for at in started.values() if t0 <= at < t1)
    # Backlog at each commit instant in the phase: committed by then, not yet started.
    events = sorted(
        [(at, 1) for at in committed.values() if at < t1]
        + [(at, -1) for at in started.values() if at < t1]
    )
    depth = deepest = 0
    for at, step in events:
        depth += step
        if at >= t0:
            deepest = max(deepest, depth)
    jobs = max(ran, 1)
    return {
        "phase": boundary["phase"].name,
        "seconds": round(t1 - t0, 1),
        "throughput": round(ran / (t1 - t0), 1),
        "deepest_backlog": deepest,
        "latency_p50_ms": round(waits[len(waits) // 2], 2) if waits else None,
        "latency_p99_ms": round(waits[int(len(waits) * 0.99) - 1], 2) if waits else None,
        "pg_cpu_ms_per_job": (
            None
            if boundary["start"]["cpu"] is None
            else round((boundary["end"]["cpu"] - boundary["start"]["cpu"]) * 1000 / jobs, 3)
        ),
        "index_tuples_per_job": round(
            (boundary["end"]["tuples"] - boundary["start"]["tuples"]) / jobs, 1
        ),
        "dead_tuples_at_end": boundary["dead"],
    }
