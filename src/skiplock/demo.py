"""``skiplock demo``: the seed lesson's scenario run end to end, with its claims checked.

Four workers drain 400 jobs inserted in one statement (every 10th flaky, job 7 broken,
handlers sleep 5 ms); then a worker process holding a transactional job is killed with
SIGKILL, and the job is shown claimable again with its attempts unchanged.

The demo works in a scratch schema of its own, dropped and rebuilt on every run. It
refuses to drop a schema it did not create, so pointing it at a real schema is harmless.
Handlers count their own executions, so "no job ran twice" is measured, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import psycopg
from psycopg import sql

from skiplock.app import App
from skiplock.config import (
    DATABASE_URL_ENV,
    EMBEDDED,
    SCHEMA_ENV,
    resolve_database_url,
    validate_schema,
)
from skiplock.context import current_job
from skiplock.errors import SkiplockError
from skiplock.retry import RetryPolicy
from skiplock.sql import render
from skiplock.tasks import JobSpec, Task
from skiplock.worker import Worker

# The lesson's scenario.
JOB_COUNT = 400
WORKER_COUNT = 4
FLAKY_EVERY = 10
BROKEN_JOB = 7
HANDLER_SECONDS = 0.005
LESSON_DRAIN_SECONDS = 1.14
# The lesson retries after 0.1 s * 2^n; no jitter, so the timing is the lesson's.
DEMO_RETRY = RetryPolicy(base=0.1, factor=2.0, cap=2.0, jitter=0.0)

DRAIN_DEADLINE_SECONDS = 60.0
DRAIN_POLL_SECONDS = 0.005
WORKER_START_SECONDS = 60.0
CRASH_START_SECONDS = 60.0
CRASH_RECOVERY_SECONDS = 15.0
# Long enough that only SIGKILL ends the crash handler; short enough that an orphaned
# child (the demo itself killed) does not linger for long.
CRASH_HOLD_SECONDS = 120.0
CRASH_QUEUE = "demo_crash"

SCHEMA_MARKER = "skiplock demo scratch schema: dropped and rebuilt by every skiplock demo"

log = logging.getLogger("skiplock.demo")

# -- SQL -------------------------------------------------------------------------------

# Drained means: nothing left in the hot table except jobs parked as dead.
DEMO_JOBS_LEFT = """
SELECT count(*) FILTER (WHERE state <> 'dead') FROM {jobs}
"""

# Where every job ended up: completed ones moved to history, dead ones stay in jobs.
DEMO_JOB_ENDINGS = """
SELECT id, task, args, state, attempts, max_attempts, errors FROM {history}
UNION ALL
SELECT id, task, args, state, attempts, max_attempts, errors FROM {jobs}
ORDER BY id
"""

SCHEMA_COMMENT_GET = """
SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = %(schema)s
"""

# The crash handler reports that it is running through a side connection (visible at
# once), and writes an effect in its own job transaction (which must die with it).
DEMO_CRASH_TABLES = """
CREATE TABLE {schema}.demo_crash_signal (
    job_id bigint PRIMARY KEY,
    pid    integer NOT NULL,
    at     timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE {schema}.demo_crash_effects (job_id bigint NOT NULL)
"""

DEMO_CRASH_SIGNAL_INSERT = """
INSERT INTO {schema}.demo_crash_signal (job_id, pid) VALUES (%(id)s, %(pid)s)
"""

DEMO_CRASH_SIGNAL_GET = """
SELECT pid FROM {schema}.demo_crash_signal WHERE job_id = %(id)s
"""

DEMO_CRASH_EFFECT_INSERT = """
INSERT INTO {schema}.demo_crash_effects (job_id) VALUES (%(id)s)
"""

DEMO_CRASH_EFFECTS_COUNT = """
SELECT count(*) FROM {schema}.demo_crash_effects WHERE job_id = %(id)s
"""

# What another worker would see: the lesson's claimability probe. In autocommit the lock
# is released as soon as the statement ends, so probing never gets in anyone's way.
DEMO_JOB_PROBE = """
SELECT id, attempts, state FROM {jobs} WHERE id = %(id)s FOR UPDATE SKIP LOCKED
"""


class DemoError(SkiplockError):
    """The demo could not run to the end (the message says where it stopped)."""


def worker_command(schema: str, target: str, *options: str) -> list[str]:
    """The command line of a ``skiplock worker`` child process running ``target``
    (module:attribute) in ``schema``. The database URL goes in its environment
    (``worker_env``), never here: a command line is readable by every user of the
    machine, and the URL may hold a password."""
    return [sys.executable, "-m", "skiplock", "--schema", schema, "worker", target, *options]


def worker_env(url: str, schema: str) -> dict[str, str]:
    """This process's environment, with the database and schema for a worker child."""
    return {**os.environ, DATABASE_URL_ENV: url, SCHEMA_ENV: schema}


# -- the crash worker's app --------------------------------------------------------------

# Imported by the worker process the demo starts (`skiplock worker skiplock.demo:crash_app`);
# the demo sets SKIPLOCK_DATABASE_URL and SKIPLOCK_SCHEMA for it. Defining an App connects
# to nothing, so importing this module has no effect.
crash_app = App(schema=os.environ.get(SCHEMA_ENV) or "skiplock_demo")


@crash_app.task(name="demo.hold_lock", queue=CRASH_QUEUE, transactional=True)
def hold_lock(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Write an effect in the job's transaction, say so on the side, then sleep."""
    job_id = current_job().id
    schema = crash_app.schema
    conn.execute(render(DEMO_CRASH_EFFECT_INSERT, schema), {"id": job_id})
    with psycopg.connect(crash_app.database_url, autocommit=True) as side:
        side.execute(render(DEMO_CRASH_SIGNAL_INSERT, schema), {"id": job_id, "pid": os.getpid()})
    time.sleep(seconds)


# -- pure parts: the scenario, the summary, the checks -----------------------------------


def kind_of(n: int) -> str:
    """The lesson's mix: job 7 is broken, every 10th is flaky, the rest are emails."""
    if n == BROKEN_JOB:
        return "broken"
    if n % FLAKY_EVERY == 0:
        return "flaky"
    return "email"


class Tally:
    """Handler-side counts, keyed by job id; handlers run in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.executions: Counter[int] = Counter()
        self.successes: Counter[int] = Counter()

    def ran(self, job_id: int) -> None:
        with self._lock:
            self.executions[job_id] += 1

    def succeeded(self, job_id: int) -> None:
        with self._lock:
            self.successes[job_id] += 1


@dataclass(frozen=True)
class Ending:
    """Where one job finished: history (completed) or the hot table (dead, or not done)."""

    id: int
    task: str
    n: int
    state: str
    attempts: int
    max_attempts: int
    errors: list[dict[str, Any]]


def summarize(
    endings: Sequence[Ending], tally: Tally, inserted: Sequence[int]
) -> tuple[dict[str, Any], dict[str, bool]]:
    """Per-kind figures, dead jobs and the checks of the lesson's claims."""
    per_kind: dict[str, dict[str, int]] = {}
    for kind in sorted({kind_of(n) for n in range(1, JOB_COUNT + 1)}):
        per_kind[kind] = {"done": 0, "dead": 0, "max_attempts_used": 0, "executions_max": 0}
    rows_per_id: Counter[int] = Counter(e.id for e in endings)
    for e in endings:
        figures = per_kind.setdefault(
            e.task, {"done": 0, "dead": 0, "max_attempts_used": 0, "executions_max": 0}
        )
        figures["done"] += e.state == "completed"
        figures["dead"] += e.state == "dead"
        figures["max_attempts_used"] = max(figures["max_attempts_used"], e.attempts)
        figures["executions_max"] = max(figures["executions_max"], tally.executions[e.id])
    dead = [
        {
            "id": e.id,
            "n": e.n,
            "task": e.task,
            "attempts": e.attempts,
            "max_attempts": e.max_attempts,
            "error": _error_text(e.errors[-1]) if e.errors else None,
            "errors": len(e.errors),
        }
        for e in endings
        if e.state == "dead"
    ]
    completed = sum(e.state == "completed" for e in endings)
    by_kind = {kind: [e for e in endings if e.task == kind] for kind in ("email", "flaky")}
    broken = [e for e in endings if e.task == "broken"]
    checks = {
        # Every inserted job ended up somewhere, exactly once.
        "every_job_accounted_for": sorted(rows_per_id) == sorted(inserted)
        and max(rows_per_id.values(), default=0) == 1,
        "emails_done_first_try": all(
            e.state == "completed" and e.attempts == 1 for e in by_kind["email"]
        ),
        "flaky_done_second_try": all(
            e.state == "completed" and e.attempts == 2 for e in by_kind["flaky"]
        ),
        "broken_dead_after_3_attempts": len(broken) == 1
        and broken[0].state == "dead"
        and broken[0].attempts == 3
        and len(broken[0].errors) == 3,
        # The handlers' own counts: each job ran exactly as often as the table says it
        # was attempted, and no job's handler succeeded twice.
        "executions_match_attempts": all(tally.executions[e.id] == e.attempts for e in endings)
        and sum(tally.executions.values()) == sum(e.attempts for e in endings),
        "no_job_completed_twice": max(tally.successes.values(), default=0) <= 1
        and all(tally.successes[e.id] == (e.state == "completed") for e in endings),
    }
    summary = {
        "jobs": len(inserted),
        "completed": completed,
        "dead": len(dead),
        "per_kind": per_kind,
        "dead_jobs": dead,
        "executions_total": sum(tally.executions.values()),
        "executions_per_job_max": max(tally.executions.values(), default=0),
        "successes_per_job_max": max(tally.successes.values(), default=0),
    }
    return summary, checks


def _error_text(error: dict[str, Any]) -> str:
    return f"{error.get('type', 'Error')}: {error.get('message', '')}"


# -- the drain: four workers, 400 jobs ---------------------------------------------------


@dataclass
class DrainResult:
    seconds: float
    endings: list[Ending]
    inserted: list[int]
    tally: Tally
    per_worker: dict[str, dict[str, Any]] = field(default_factory=dict)


def _define_tasks(app: App, tally: Tally) -> dict[str, Task[None]]:
    """The lesson's three kinds. Names are given: they are what the table stores."""

    def handle(fail: Exception | None, only_first_attempt: bool) -> None:
        job = current_job()
        tally.ran(job.id)
        time.sleep(HANDLER_SECONDS)  # pretend to work
        # In lease mode the claimed attempts already count this attempt: 1 is the first.
        if fail is not None and (job.attempts == 1 or not only_first_attempt):
            raise fail
        tally.succeeded(job.id)

    @app.task(name="email", retry=DEMO_RETRY)
    def email(n: int) -> None:
        handle(None, only_first_attempt=False)

    @app.task(name="flaky", retry=DEMO_RETRY)
    def flaky(n: int) -> None:
        handle(RuntimeError("upstream timeout"), only_first_attempt=True)

    @app.task(name="broken", retry=DEMO_RETRY, max_attempts=3)
    def broken(n: int) -> None:
        handle(ValueError("bad payload"), only_first_attempt=False)

    return {"email": email, "flaky": flaky, "broken": broken}


async def _wait_ready(workers: Sequence[Worker], runs: Sequence[asyncio.Task[None]]) -> None:
    """Wait until every worker listens and polls; fail fast if one of them dies first."""
    ready: asyncio.Future[Any] = asyncio.ensure_future(
        asyncio.gather(*(w.ready.wait() for w in workers))
    )
    waiting: list[asyncio.Future[Any]] = [ready, *runs]
    done, _ = await asyncio.wait(
        waiting, timeout=WORKER_START_SECONDS, return_when=asyncio.FIRST_COMPLETED
    )
    if ready in done:
        return
    ready.cancel()
    for run in runs:
        if run.done() and not run.cancelled() and run.exception() is not None:
            raise DemoError(f"a worker failed to start: {run.exception()!r}")
    raise DemoError(f"the workers were not ready within {WORKER_START_SECONDS:.0f} s")


async def _stop(workers: Sequence[Worker], runs: Sequence[asyncio.Task[None]]) -> None:
    for worker in workers:
        worker.request_stop()
    _, pending = await asyncio.wait(runs, timeout=30)
    for run in pending:
        run.cancel()
    await asyncio.gather(*runs, return_exceptions=True)


async def _drain(url: str, schema: str, prefetch: int | None = None) -> DrainResult:
    app = App(url, schema=schema)
    tally = Tally()
    tasks = _define_tasks(app, tally)
    specs: list[JobSpec] = [tasks[kind_of(n)].job(n=n) for n in range(1, JOB_COUNT + 1)]
    workers = [
        Worker(app, queues=["default"], concurrency=1, poll_interval=0.05, prefetch=prefetch)
        for _ in range(WORKER_COUNT)
    ]
    runs = [
        asyncio.create_task(w.run_async(), name=f"demo-worker-{i}") for i, w in enumerate(workers)
    ]
    try:
        # Workers first, as in the lesson: the insert's notification wakes them.
        await _wait_ready(workers, runs)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            started = time.perf_counter()
            async with conn.transaction():
                inserted = await app.enqueue_many_async(conn, specs)
            left_sql = render(DEMO_JOBS_LEFT, schema)
            while True:
                cur = await conn.execute(left_sql)
                row = await cur.fetchone()
                if row is not None and row[0] == 0:
                    break
                if time.perf_counter() - started > DRAIN_DEADLINE_SECONDS:
                    raise DemoError(
                        f"{row[0] if row else '?'} jobs still not finished after "
                        f"{DRAIN_DEADLINE_SECONDS:.0f} s"
                    )
                for run in runs:
                    if run.done():
                        raise DemoError(f"a worker stopped during the drain: {run!r}")
                await asyncio.sleep(DRAIN_POLL_SECONDS)
            seconds = time.perf_counter() - started
    finally:
        await _stop(workers, runs)
    per_worker: dict[str, dict[str, Any]] = {}
    for i, worker in enumerate(workers):
        stats = worker.completer.stats if worker.completer else None
        per_worker[f"w{i}"] = {
            "id": str(worker.id),
            "completed": stats.completed if stats else 0,
            "retried": stats.retried if stats else 0,
            "dead": stats.dead if stats else 0,
            "refused": stats.refused if stats else 0,
        }
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(render(DEMO_JOB_ENDINGS, schema)).fetchall()
    endings = [
        Ending(
            id=r[0],
            task=r[1],
            n=int(r[2].get("n", 0)),
            state=r[3],
            attempts=r[4],
            max_attempts=r[5],
            errors=r[6],
        )
        for r in rows
    ]
    return DrainResult(seconds, endings, inserted, tally, per_worker)


# -- the crash: SIGKILL a worker holding a transactional job ----------------------------


@dataclass
class CrashResult:
    job_id: int
    pid: int
    claimable_while_alive: list[tuple[int, int, str]]
    claimable_after_kill: list[tuple[int, int, str]]
    recovered_seconds: float | None
    effects_after_kill: int

    @property
    def recovered(self) -> bool:
        return (
            not self.claimable_while_alive
            and len(self.claimable_after_kill) == 1
            and self.claimable_after_kill[0][1] == 0
            and self.effects_after_kill == 0
        )


def _probe(conn: psycopg.Connection[Any], schema: str, job_id: int) -> list[tuple[int, int, str]]:
    rows = conn.execute(render(DEMO_JOB_PROBE, schema), {"id": job_id}).fetchall()
    return [(int(r[0]), int(r[1]), str(r[2])) for r in rows]


def _child_output(output: IO[bytes]) -> str:
    output.flush()
    output.seek(0)
    text = output.read().decode("utf-8", "replace").strip()
    return "\n".join(text.splitlines()[-20:])


def _crash(url: str, schema: str) -> CrashResult:
    app = App(url, schema=schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(render(DEMO_CRASH_TABLES, schema).encode())
        [job_id] = app.enqueue_many(conn, [hold_lock.job(seconds=CRASH_HOLD_SECONDS)])
        command = worker_command(
            schema,
            "skiplock.demo:crash_app",
            *("--queues", CRASH_QUEUE, "--concurrency", "1", "--poll-interval", "0.05"),
        )
        env = worker_env(url, schema)
        with tempfile.TemporaryFile() as output:
            child = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output
            )
            try:
                return _kill_and_watch(conn, schema, job_id, child)
            except DemoError as exc:
                raise DemoError(f"{exc}\nworker process output:\n{_child_output(output)}") from None
            finally:
                if child.poll() is None:
                    child.kill()
                child.wait()


def _kill_and_watch(
    conn: psycopg.Connection[Any],
    schema: str,
    job_id: int,
    child: subprocess.Popen[bytes],
) -> CrashResult:
    signal_sql = render(DEMO_CRASH_SIGNAL_GET, schema)
    deadline = time.monotonic() + CRASH_START_SECONDS
    while True:
        row = conn.execute(signal_sql, {"id": job_id}).fetchone()
        if row is not None:
            break
        if child.poll() is not None:
            raise DemoError(f"the worker process exited with {child.returncode} before its job ran")
        if time.monotonic() > deadline:
            raise DemoError(f"the worker process did not start job {job_id} within the deadline")
        time.sleep(0.02)
    while_alive = _probe(conn, schema, job_id)
    child.send_signal(signal.SIGKILL)
    child.wait()
    killed = time.monotonic()
    # PostgreSQL sees the connection close, aborts the transaction and drops its locks.
    after: list[tuple[int, int, str]] = []
    while time.monotonic() - killed < CRASH_RECOVERY_SECONDS:
        after = _probe(conn, schema, job_id)
        if after:
            break
        time.sleep(0.005)
    recovered_seconds = time.monotonic() - killed if after else None
    effects = conn.execute(render(DEMO_CRASH_EFFECTS_COUNT, schema), {"id": job_id}).fetchone()
    return CrashResult(
        job_id=job_id,
        pid=int(row[0]),
        claimable_while_alive=while_alive,
        claimable_after_kill=after,
        recovered_seconds=recovered_seconds,
        effects_after_kill=int(effects[0]) if effects else -1,
    )


# -- setting up, reporting --------------------------------------------------------------


def _reset_schema(url: str, schema: str) -> str:
    """Drop and re-migrate the demo schema; refuse to touch one the demo did not make."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(SCHEMA_COMMENT_GET, {"schema": schema}).fetchone()
        if row is not None and row[0] != SCHEMA_MARKER:
            raise DemoError(
                f"schema {schema!r} exists and was not created by the demo; refusing to drop "
                "it. Run the demo in its own schema (for example skiplock_demo)."
            )
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    App(url, schema=schema).migrate()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("COMMENT ON SCHEMA {} IS {}").format(
                sql.Identifier(schema), sql.Literal(SCHEMA_MARKER)
            )
        )
        version = conn.execute("SHOW server_version").fetchone()
    # "15.4 (Debian 15.4-1)" -> "15.4"
    return str(version[0]).split()[0] if version else "?"


@contextlib.contextmanager
def _quiet_workers() -> Iterator[None]:
    """Workers log their start and stop at INFO, and each failed attempt (skiplock.jobs)
    at WARNING with its traceback; the demo's flaky and broken jobs fail by design, and
    its report says how they ended: the report is the demo's output."""
    loggers = {logging.getLogger("skiplock"): logging.WARNING}
    loggers[logging.getLogger("skiplock.jobs")] = logging.CRITICAL
    previous = {logger: logger.level for logger in loggers}
    for logger, level in loggers.items():
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, level in previous.items():
            logger.setLevel(level)


def run(database_url: str | None, schema: str, prefetch: int | None = None) -> dict[str, Any]:
    """Run both halves of the demo and return the report (what ``--json`` prints)."""
    validate_schema(schema)
    # With nothing configured the demo runs on the embedded server: it is a try-out.
    embedded = (database_url or os.environ.get(DATABASE_URL_ENV) or EMBEDDED) == EMBEDDED
    url = resolve_database_url(database_url, fallback_embedded=True)
    version = _reset_schema(url, schema)
    with _quiet_workers():
        drain = asyncio.run(_drain(url, schema, prefetch))
        crash = _crash(url, schema)
    summary, checks = summarize(drain.endings, drain.tally, drain.inserted)
    checks["crash_recovered"] = crash.recovered
    return {
        "server": {"version": version, "embedded": embedded},
        "schema": schema,
        "workers": WORKER_COUNT,
        "drain_seconds": round(drain.seconds, 3),
        "lesson_drain_seconds": LESSON_DRAIN_SECONDS,
        **summary,
        "per_worker": drain.per_worker,
        "crash": {
            "job_id": crash.job_id,
            "worker_pid": crash.pid,
            "claimable_while_alive": crash.claimable_while_alive,
            "claimable_after_kill": crash.claimable_after_kill,
            "recovered_seconds": (
                None if crash.recovered_seconds is None else round(crash.recovered_seconds, 3)
            ),
            "handler_writes_after_kill": crash.effects_after_kill,
        },
        "crash_recovered": crash.recovered,
        "checks": checks,
        "ok": all(checks.values()),
    }


def render_text(report: dict[str, Any]) -> str:
    """The human report, in the lesson's order."""
    server = report["server"]
    where = "embedded" if server["embedded"] else "configured"
    lines = [
        f"skiplock demo on PostgreSQL {server['version']} ({where}), schema {report['schema']}",
        "",
        f"{report['workers']} workers ready; {report['jobs']} jobs inserted in one statement "
        f"(every {FLAKY_EVERY}th flaky, job {BROKEN_JOB} broken, handlers sleep "
        f"{HANDLER_SECONDS * 1000:.0f} ms)",
        f"drained in {report['drain_seconds']:.2f} s "
        f"(the lesson's hand-written worker: {report['lesson_drain_seconds']:.2f} s, "
        "on another machine)",
        "jobs completed per worker: "
        + ", ".join(f"{name} {w['completed']}" for name, w in report["per_worker"].items()),
        "",
        f"{'kind':<8}{'done':>6}{'dead':>6}  max attempts used",
    ]
    for kind, figures in report["per_kind"].items():
        lines.append(
            f"{kind:<8}{figures['done']:>6}{figures['dead']:>6}  {figures['max_attempts_used']}"
        )
    lines.append("")
    lines.append("dead jobs:" if report["dead_jobs"] else "dead jobs: none")
    for job in report["dead_jobs"]:
        lines.append(
            f"  job {job['id']} ({job['task']}, n={job['n']}): "
            f"{job['attempts']}/{job['max_attempts']} attempts, last error {job['error']}"
        )
    checks = report["checks"]
    lines += [
        "",
        f"handlers ran {report['executions_total']} times for {report['jobs']} jobs; "
        + (
            "every job ran exactly as often as its recorded attempts"
            if checks["executions_match_attempts"]
            else "executions and recorded attempts DISAGREE"
        )
        + (
            ", and none completed twice"
            if checks["no_job_completed_twice"]
            else ", and some job COMPLETED TWICE"
        ),
        "",
        "crash case (transactional mode):",
    ]
    crash = report["crash"]
    lines += [
        f"  worker process {crash['worker_pid']} claimed job {crash['job_id']} and is running it",
        f"  another session sees it as claimable: {crash['claimable_while_alive']}",
        "  SIGKILL",
        f"  after the worker died: {[tuple(r) for r in crash['claimable_after_kill']]}",
        "  (id, attempts, state): "
        + (
            f"claimable again {crash['recovered_seconds'] * 1000:.0f} ms after the kill"
            if crash["recovered_seconds"] is not None
            else f"still locked {CRASH_RECOVERY_SECONDS:.0f} s after the kill"
        )
        + "; the handler's own write rolled back with it "
        + f"({crash['handler_writes_after_kill']} rows left)",
        "",
    ]
    failed = [name for name, ok in checks.items() if not ok]
    lines.append(
        f"all {len(checks)} checks hold" if not failed else "checks FAILED: " + ", ".join(failed)
    )
    return "\n".join(lines)


def main(database_url: str | None, schema: str, as_json: bool, prefetch: int | None = None) -> int:
    """Run the demo and print its report; 0 when every check holds, 1 otherwise."""
    try:
        report = run(database_url, schema, prefetch)
    except DemoError as exc:
        if as_json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        print(f"skiplock demo: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report) if as_json else render_text(report))
    return 0 if report["ok"] else 1
