"""The ``enqueue-concurrent`` scenario: what a job's insert costs the business transaction
it is part of. One order row and one job, committed by each of ``--clients`` numbers of
clients (8, 32 and 64 by default), through ``Task.enqueue`` and through a plain SQL
``INSERT``, against the same transaction into a second skiplock schema whose jobs table
has no insert trigger; measured and reference runs alternate. First with no worker
running, then with one idle worker process on each schema (it drains what is enqueued:
that is when an insert still sends a wake-up).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.bench.load import fresh_schema, wait_drained
from skiplock.bench.measure import Figure, Report, Settings
from skiplock.bench.pgbench import pgbench_path, run_pgbench
from skiplock.bench.tasks import BENCH_SCHEMA, noop
from skiplock.bench.workers import WORKER_SLOTS, worker_processes

COMMIT_CLIENTS = (8, 32, 64)
# Python clients: threads spread over this many processes (spawned), as web servers run.
CLIENT_PROCESSES = 4
NO_TRIGGER_SCHEMA = "skiplock_bench_notrigger"
PATH_ENQUEUE = "Task.enqueue"
PATH_SQL = "SQL INSERT"
COMMIT_PATHS = (PATH_ENQUEUE, PATH_SQL)

# The business row each transaction writes besides its job.
ORDERS_TABLE = """
CREATE TABLE {orders} (
    id         bigserial PRIMARY KEY,
    customer   integer NOT NULL,
    total      numeric(12, 2) NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)"""
ORDER_INSERT = "INSERT INTO {orders} (customer, total) VALUES (%s, 19.90)"
# A job as plain SQL writes it: every other column is the table's default.
PLAIN_JOB_INSERT = "INSERT INTO {jobs} (task, args) VALUES ('bench.noop', '{{}}')"
PGBENCH_SCRIPT = """\\set customer random(1, 1000)
BEGIN;
INSERT INTO {orders} (customer, total) VALUES (:customer, 19.90);
INSERT INTO {jobs} (task, args) VALUES ('bench.noop', '{{}}');
END;
"""


def _orders(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, "bench_orders")


def _jobs(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, "jobs")


def _render(template: str, schema: str) -> sql.Composed:
    return sql.SQL(template).format(orders=_orders(schema), jobs=_jobs(schema))


# --- Python clients ------------------------------------------------------------------


def _client_transaction(
    url: str, conn: psycopg.Connection[Any], schema: str, path: str, tasks: dict[str, Any]
) -> Callable[[], None]:
    """One business transaction on ``conn`` through ``path``, as a callable."""
    order = _render(ORDER_INSERT, schema)
    if path == PATH_SQL:
        job = _render(PLAIN_JOB_INSERT, schema)

        def plain() -> None:
            conn.execute(order, (random.randint(1, 1000),))
            conn.execute(job)
            conn.commit()

        return plain
    if schema not in tasks:
        bench_app = App(url, schema=schema)
        tasks[schema] = bench_app.task(name="bench.noop")(noop.fn)
    task = tasks[schema]

    def enqueue() -> None:
        conn.execute(order, (random.randint(1, 1000),))
        task.enqueue(conn)
        conn.commit()

    return enqueue


def _client_run(
    url: str,
    command: tuple[str, str, int, float],
    tasks: dict[str, Any],
    signals: tuple[Any, Any],
    say: Callable[[str, object], None],
) -> int:
    """Connect ``threads`` clients, say so, then commit transactions from all of them
    until ``seconds`` after the start (none if the run is called off): the number
    committed by then."""
    schema, path, threads, seconds = command
    start, abort = signals
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(psycopg.connect(url)) for _ in range(threads)]
        steps = [_client_transaction(url, conn, schema, path, tasks) for conn in conns]
        go = threading.Event()
        deadline = [0.0]
        counts = [0] * threads
        errors: list[BaseException] = []

        def client(index: int) -> None:
            go.wait()
            step = steps[index]
            try:
                while time.monotonic() < deadline[0]:
                    step()
                    if time.monotonic() >= deadline[0]:
                        break
                    counts[index] += 1
            except BaseException as exc:  # reported by the process, not lost in a thread
                errors.append(exc)

        running = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
        for thread in running:
            thread.start()
        say("ready", 0)
        started = start.wait(120) and not abort.is_set()
        deadline[0] = time.monotonic() + (seconds if started else 0.0)
        go.set()
        for thread in running:
            thread.join()
        if errors:
            raise errors[0]
        return sum(counts)


def _client_process(url: str, index: int, commands: Any, signals: Any, results: Any) -> None:
    """A client process: runs the commands it is sent until it is sent None."""
    tasks: dict[str, Any] = {}

    def say(kind: str, value: object) -> None:
        results.put((kind, index, value))

    while (command := commands.get()) is not None:
        try:
            say("done", _client_run(url, command, tasks, signals, say))
        except Exception:
            say("error", traceback.format_exc())


class ClientPool:
    """Python client processes (spawned: the URL travels through a pipe, not a command
    line), kept for a whole scenario so that no run pays for starting them."""

    def __init__(self, url: str, processes: int = CLIENT_PROCESSES) -> None:
        context = multiprocessing.get_context("spawn")
        self._start = context.Event()
        self._abort = context.Event()
        self._results: Any = context.Queue()
        self._commands: list[Any] = [context.Queue() for _ in range(processes)]
        signals = (self._start, self._abort)
        self._children = [
            context.Process(
                target=_client_process, args=(url, index, commands, signals, self._results)
            )
            for index, commands in enumerate(self._commands)
        ]

    def __enter__(self) -> ClientPool:
        for child in self._children:
            child.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._abort.set()  # a child still waiting for a start gives up at once
        self._start.set()
        for commands in self._commands:
            commands.put(None)
        for child in self._children:
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()

    def shape(self, clients: int) -> str:
        processes = min(clients, len(self._children))
        threads = -(-clients // processes)
        return f"python, {processes} processes x {threads} threads"

    def _next(self, deadline: float) -> tuple[str, int, Any]:
        while True:
            try:
                kind, index, value = self._results.get(timeout=1)
                return str(kind), int(index), value
            except queue.Empty:
                dead = [c.exitcode for c in self._children if c.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"bench client processes stopped answering (exit codes {dead})"
                    ) from None

    def run(self, schema: str, path: str, clients: int, seconds: float) -> float:
        """Transactions per second committed by ``clients`` threads through ``path``. If a
        process fails to get ready, the others are called off and their answers taken,
        so the pool is ready for the next run, and the failure is raised."""
        self._start.clear()
        self._abort.clear()
        processes = len(self._children)
        shares = [len(range(i, clients, processes)) for i in range(processes)]
        busy = {i for i, share in enumerate(shares) if share}
        for i in busy:
            self._commands[i].put((schema, path, shares[i], seconds))
        deadline = time.monotonic() + 120
        waiting = set(busy)
        failure: str | None = None
        while waiting:
            kind, index, value = self._next(deadline)
            waiting.discard(index)
            if kind == "error":  # before its clients were ready: that process is done
                failure = str(value)
                busy.discard(index)
        if failure is not None:
            self._abort.set()
        self._start.set()
        deadline = time.monotonic() + seconds + 120
        total, answered = 0, 0
        while answered < len(busy):
            kind, _, value = self._next(deadline)
            answered += 1
            if kind == "error":
                failure = failure or str(value)
            else:
                total += int(value)
        if failure is not None:
            raise RuntimeError(f"a bench client failed:\n{failure}")
        return total / seconds


# --- the scenario --------------------------------------------------------------------


@contextlib.contextmanager
def commit_schemas(url: str) -> Iterator[tuple[str, str]]:
    """The measured schema and its reference: the same migrations, an orders table in
    each, and the reference's jobs table without any insert trigger."""
    with (
        fresh_schema(url, BENCH_SCHEMA),
        fresh_schema(url, NO_TRIGGER_SCHEMA),
        psycopg.connect(url, autocommit=True) as conn,
    ):
        for schema in (BENCH_SCHEMA, NO_TRIGGER_SCHEMA):
            conn.execute(_render(ORDERS_TABLE, schema))
        set_insert_triggers(conn, NO_TRIGGER_SCHEMA, enabled=False)
        yield BENCH_SCHEMA, NO_TRIGGER_SCHEMA


def set_insert_triggers(conn: psycopg.Connection[Any], schema: str, enabled: bool) -> None:
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


def _between_runs(conn: psycopg.Connection[Any], schema: str, worker: bool) -> None:
    """Every run starts from the same tables: emptied with no worker; drained, and its
    dead rows vacuumed, with one."""
    if worker:
        wait_drained(conn, schema, timeout=600)
        conn.execute(sql.SQL("TRUNCATE {}").format(_orders(schema)))
        conn.execute(sql.SQL("VACUUM {}").format(_jobs(schema)))
    else:
        conn.execute(sql.SQL("TRUNCATE {}, {}").format(_orders(schema), _jobs(schema)))


def enqueue_concurrent(
    url: str, seconds: float, runs: int, clients: Sequence[int] = COMMIT_CLIENTS
) -> list[Figure]:
    """Transactions per second of an order plus a job, per insert path and client count,
    against the same transaction with no trigger on the jobs table (``vs_no_trigger``);
    runs alternate, measured then reference. Plain SQL runs under pgbench when there is
    one (whole seconds), else as Python clients; each figure says which."""
    pgbench = pgbench_path()
    figures: list[Figure] = []
    with (
        ClientPool(url) as pool,
        psycopg.connect(url, autocommit=True) as conn,
    ):
        for worker in (False, True):
            with commit_schemas(url) as schemas, contextlib.ExitStack() as workers:
                if worker:
                    for schema in schemas:
                        workers.enter_context(worker_processes(url, schema, 1, WORKER_SLOTS))
                for path in COMMIT_PATHS:
                    for count in clients:
                        figures += _commit_pair(
                            conn, pool, pgbench, url, schemas, path, count, seconds, runs, worker
                        )
    return figures


# Connection slots this session's role may still open: a superuser may use those kept for
# superusers too. Walsenders, autovacuum and background workers have slots of their own.
FREE_CONNECTIONS = """
SELECT current_setting('max_connections')::int
       - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')
       - CASE WHEN (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN 0
              ELSE current_setting('superuser_reserved_connections')::int
                   + coalesce(current_setting('reserved_connections', true)::int, 0)
         END
"""


def _wait_for_connections(conn: psycopg.Connection[Any], clients: int) -> None:
    """Wait until the server has a slot for each client (sessions of others sharing it
    come and go), for a minute at most; then say what is missing."""
    deadline = time.monotonic() + 60
    while True:
        row = conn.execute(FREE_CONNECTIONS).fetchone()
        free = int(row[0]) if row is not None else 0
        if free >= clients:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"enqueue-concurrent needs {clients} connections at once and the server "
                f"has {free} free (raise max_connections, or stop other sessions)"
            )
        time.sleep(0.5)


# What the server says when it has no connection slot left.
NO_SLOTS = ("too many clients", "remaining connection slots are reserved")
RUN_ATTEMPTS = 5


def _commit_run(
    conn: psycopg.Connection[Any],
    pool: ClientPool,
    pgbench: Path | None,
    url: str,
    schema: str,
    path: str,
    clients: int,
    seconds: float,
    worker: bool,
) -> float:
    """One run's transactions per second, under pgbench when it is given (whole
    seconds), else from the pool. A run that could not open all its connections, other
    sessions on the server having taken the slots it waited for, is run again."""
    for attempt in range(1, RUN_ATTEMPTS + 1):
        _between_runs(conn, schema, worker)
        _wait_for_connections(conn, clients)
        try:
            if pgbench is not None:
                script = _render(PGBENCH_SCRIPT, schema).as_string(conn)
                done = run_pgbench(
                    pgbench, url, script, clients=clients, seconds=max(1, round(seconds))
                )
                return done.tps
            return pool.run(schema, path, clients, seconds)
        except RuntimeError as exc:
            if attempt == RUN_ATTEMPTS or not any(text in str(exc) for text in NO_SLOTS):
                raise
            print(
                f"enqueue-concurrent: the server ran out of connections during a run of "
                f"{clients} clients; running it again",
                file=sys.stderr,
                flush=True,
            )
    raise AssertionError("unreachable")


def _commit_pair(
    conn: psycopg.Connection[Any],
    pool: ClientPool,
    pgbench: Path | None,
    url: str,
    schemas: tuple[str, str],
    path: str,
    clients: int,
    seconds: float,
    runs: int,
    worker: bool,
) -> list[Figure]:
    name = f"enqueue-concurrent {path}, {clients} clients" + (", idle worker" if worker else "")
    measured = Figure(name, "tx/s")
    reference = Figure(name + ", no trigger", "tx/s")
    use_pgbench = path == PATH_SQL and pgbench is not None
    for _ in range(runs):
        for schema, figure in zip(schemas, (measured, reference), strict=True):
            figure.runs.append(
                _commit_run(
                    conn,
                    pool,
                    pgbench if use_pgbench else None,
                    url,
                    schema,
                    path,
                    clients,
                    seconds,
                    worker,
                )
            )
    client = f"pgbench, {clients} connections" if use_pgbench else pool.shape(clients)
    workers = f"1 process x {WORKER_SLOTS} slots on each schema" if worker else "none"
    for figure in (measured, reference):
        figure.extra.update(client=client, workers=workers)
    measured.extra["vs_no_trigger"] = round(measured.median / reference.median, 2)
    return [measured, reference]


def scenario(name: str, settings: Settings, report: Report) -> None:
    s = settings
    report.figure(*enqueue_concurrent(s.url, s.enqueue_seconds, s.runs, s.clients))
