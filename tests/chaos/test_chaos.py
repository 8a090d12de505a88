"""Chaos: real worker processes draining real jobs while the test breaks things.

Each scenario enqueues ``SKIPLOCK_CHAOS_JOBS`` jobs (see conftest.py), starts four
``skiplock worker`` processes, and while they drain the queue it SIGKILLs them, cuts their
connections, restarts the server, stops one past its lease, or SIGTERMs them. The handlers
(``chaos_app.py``) record every execution through a connection of their own, so the
checks are computed from what happened:

- every job ends completed, or dead when it was designed to fail;
- no job is lost: every enqueued id is in job_history exactly once, or dead in jobs;
- no stale completion is accepted: the history row is the attempt, and the process, of
  the job's last execution;
- a job ran more than once only where a rescue or release recorded on the job explains it
  (WorkerLost, LeaseExpired, Reconciled, WorkerShutdown), for an attempt run by a worker the test
  killed, cut off, stopped or signalled.

The figures (recovery time after SIGKILL, re-runs and why, throughput against a calm run
of the same size) are printed at the end of the run; docs/reliability.md has a large run's.
"""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import WorkerThread, wait_until
from processes import WorkerProcess

from .chaos_app import (
    ASYNC_TASK,
    DOOMED_TASK,
    QUEUE,
    SYNC_TASK,
    app,
    doomed,
    work_async,
    work_sync,
)
from .conftest import (
    EXIT_TIMEOUT,
    JOBS,
    SCHEMA,
    STARTUP_TIMEOUT,
    ChaosDatabase,
    Event,
    Fleet,
    PrivateServer,
    record_figures,
    size_timeout,
    utcnow,
)

pytestmark = pytest.mark.chaos

WORKERS = 4
CONCURRENCY = 6
# One job in a hundred always fails (max_attempts 2): it must end dead, not lost.
DOOMED_EVERY = 100
DESIGNED_FAILURE = "DoomedError"
SHORT_MS = (20, 100)
TIMEOUT = size_timeout(120.0)
DRAIN_DEADLINE = 60.0 + JOBS / 50
POLL = 0.05


# -- jobs -----------------------------------------------------------------------------------


def make_jobs(
    count: int, rng: random.Random, *, long_share: float = 0.0, long_ms: int = 2500
) -> list[skiplock.JobSpec]:
    """Half async, half sync, one in a hundred doomed; ``long_share`` of them long."""
    specs = []
    for i in range(count):
        ms = long_ms if rng.random() < long_share else rng.randint(*SHORT_MS)
        if i % DOOMED_EVERY == DOOMED_EVERY - 1:
            specs.append(doomed.job(ms=rng.randint(*SHORT_MS)))
        elif i % 2:
            specs.append(work_sync.job(ms=ms))
        else:
            specs.append(work_async.job(ms=ms))
    return specs


def enqueue(db: ChaosDatabase, specs: list[skiplock.JobSpec]) -> list[int]:
    with db.conn.transaction():
        return app.enqueue_many(db.conn, specs)


def unfinished(db: ChaosDatabase) -> int:
    return int(db.scalar(f"SELECT count(*) FROM {SCHEMA}.jobs WHERE state <> 'dead'"))


def drain(
    db: ChaosDatabase,
    fleet: Fleet,
    chaos: Callable[[], object] | None = None,
    every: float = 1.0,
    deadline: float = DRAIN_DEADLINE,
) -> None:
    """Poll until no job is left but dead ones; run ``chaos`` every ``every`` seconds
    meanwhile (the schedule of the chaos, not a wait for an outcome)."""
    start = time.monotonic()
    next_chaos = start + every
    while unfinished(db):
        fleet.check()
        now = time.monotonic()
        if now - start > deadline:
            raise AssertionError(f"not drained after {deadline:.0f}s:\n{diagnose(db, fleet)}")
        if chaos is not None and now >= next_chaos:
            chaos()
            next_chaos = time.monotonic() + every
        time.sleep(POLL)


def diagnose(db: ChaosDatabase, fleet: Fleet) -> str:
    states = db.conn.execute(
        f"SELECT state, count(*), min(lease_expires_at) FROM {SCHEMA}.jobs GROUP BY state"
    ).fetchall()
    left = db.conn.execute(
        f"SELECT j.id, j.state, j.attempts, j.task, w.pid, j.lease_expires_at"
        f" FROM {SCHEMA}.jobs AS j LEFT JOIN {SCHEMA}.workers AS w ON w.id = j.worker_id"
        " WHERE j.state <> 'dead' ORDER BY j.id LIMIT 20"
    ).fetchall()
    # Each worker's lines that name a job left, then its log's tail: a stuck job's story
    # is usually older than the tail.
    marks = [f"job {row[0]} " for row in left]

    def story(log: str) -> str:
        return "".join(line for line in log.splitlines(True) if any(m in line for m in marks))

    tails = "\n".join(
        f"--- {w.appname} ({w.pid})\n{story(w.log())[-3000:]}...\n{w.log()[-1500:]}"
        for w in fleet.alive()
    )
    return f"jobs left by state: {states}\njobs left but dead ones: {left}\n{tails}"


# -- judging a run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Execution:
    job_id: int
    attempt: int
    pid: int
    task: str
    started: datetime
    finished: datetime | None


@dataclass
class Verdict:
    """What happened to every enqueued job, computed from the tables."""

    jobs: int
    completed: int = 0
    dead: int = 0
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    not_as_designed: list[str] = field(default_factory=list)
    stale_accepted: list[str] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    # Executions that did not produce the job's outcome, by the reasons recorded on the job
    # for their attempt ("DoomedError" for the designed failures).
    superseded: list[tuple[Execution, frozenset[str]]] = field(default_factory=list)
    # Rescues and releases of attempts that no handler had started (no execution).
    silent: Counter[str] = field(default_factory=Counter)
    executions: dict[int, list[Execution]] = field(default_factory=dict)
    errors: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    first_start: datetime | None = None
    last_finish: datetime | None = None

    @property
    def reruns(self) -> Counter[str]:
        return Counter(
            "+".join(sorted(reasons))
            for _, reasons in self.superseded
            if DESIGNED_FAILURE not in reasons
        )

    @property
    def seconds(self) -> float:
        assert self.first_start is not None and self.last_finish is not None
        return (self.last_finish - self.first_start).total_seconds()

    @property
    def throughput(self) -> float:
        return (self.completed + self.dead) / self.seconds

    def assert_sound(self, allowed: set[str], culprits: dict[str, set[int]]) -> None:
        """No job lost, duplicated or finished otherwise than designed; no stale outcome
        accepted; every re-run explained by a reason in ``allowed``, and for reasons in
        ``culprits``, by a worker the test acted on."""
        for execution, reasons in self.superseded:
            if reasons == {DESIGNED_FAILURE} and execution.task == DOOMED_TASK:
                continue
            known = reasons <= allowed | (
                {DESIGNED_FAILURE} if execution.task == DOOMED_TASK else set()
            )
            justified = any(
                r in allowed and (r not in culprits or execution.pid in culprits[r])
                for r in reasons
            )
            if not (known and justified):
                runs = sorted(self.executions[execution.job_id], key=lambda e: e.started)
                self.unexplained.append(
                    f"{execution} reasons={sorted(reasons)}; all runs of the job: {runs}; "
                    f"its errors: {self.errors.get(execution.job_id)}"
                )
        assert self.lost == [], f"jobs lost: {self.lost[:20]}"
        assert self.duplicated == [], f"jobs in history twice: {self.duplicated[:20]}"
        assert self.not_as_designed == [], self.not_as_designed[:20]
        assert self.stale_accepted == [], self.stale_accepted[:20]
        assert self.unexplained == [], "\n".join(self.unexplained[:20])
        assert self.completed + self.dead == self.jobs

    def figures(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "completed": self.completed,
            "dead": self.dead,
            "lost": len(self.lost),
            "stale_accepted": len(self.stale_accepted),
            "seconds": round(self.seconds, 2),
            "throughput": round(self.throughput, 1),
            "reruns": dict(self.reruns),
            "silent_rescues": dict(self.silent),
        }


def judge(db: ChaosDatabase, ids: list[int]) -> Verdict:
    conn = db.conn
    history: dict[int, list[tuple[Any, ...]]] = {}
    for row in conn.execute(
        f"SELECT id, task, attempts, result, errors, finished_at FROM {SCHEMA}.job_history"
    ):
        history.setdefault(int(row[0]), []).append(row)
    live = {
        int(row[0]): row
        for row in conn.execute(f"SELECT id, task, state, attempts, errors FROM {SCHEMA}.jobs")
    }
    executions: dict[int, list[Execution]] = {}
    for row in conn.execute(
        "SELECT job_id, attempt, pid, task, started_at, finished_at FROM chaos_executions"
    ):
        executions.setdefault(int(row[0]), []).append(Execution(*row))
    verdict = Verdict(jobs=len(ids), executions=executions)
    starts = [e.started for runs in executions.values() for e in runs]
    verdict.first_start = min(starts) if starts else None
    for job_id in ids:
        runs = sorted(executions.get(job_id, []), key=lambda e: (e.attempt, e.started))
        done = history.get(job_id, [])
        row = live.get(job_id)
        if len(done) > 1:
            verdict.duplicated.append(job_id)
        if done:
            _, task, attempts, result, errors, finished = done[0]
            verdict.completed += 1
            if verdict.last_finish is None or finished > verdict.last_finish:
                verdict.last_finish = finished
            if task == DOOMED_TASK:
                verdict.not_as_designed.append(f"job {job_id} ({task}) completed")
            if not runs:
                verdict.not_as_designed.append(f"job {job_id} completed without running")
                continue
            last = runs[-1]
            if (attempts, result) != (last.attempt, {"pid": last.pid, "attempt": last.attempt}):
                verdict.stale_accepted.append(
                    f"job {job_id}: history attempt {attempts} result {result}, "
                    f"last execution {last}"
                )
            superseded = runs[:-1]
        elif row is not None and row[2] == "dead":
            _, task, _, attempts, errors = row
            verdict.dead += 1
            if task != DOOMED_TASK:
                verdict.not_as_designed.append(f"job {job_id} ({task}) dead: {errors[-1:]}")
            superseded = runs
        else:
            verdict.lost.append(job_id)
            continue
        verdict.errors[job_id] = errors
        for execution in superseded:
            verdict.superseded.append((execution, rerun_reasons(execution, runs, errors)))
        ran = {e.attempt for e in runs}
        for error in errors:
            if error["type"] != DESIGNED_FAILURE and error["attempt"] not in ran:
                verdict.silent[error["type"]] += 1
    if verdict.last_finish is None and verdict.first_start is not None:
        verdict.last_finish = verdict.first_start
    return verdict


def rerun_reasons(
    execution: Execution, runs: list[Execution], errors: list[dict[str, Any]]
) -> frozenset[str]:
    """The recorded reasons an execution was run again. A job claimed ahead whose worker
    died before (or just as) it started gets its attempt back (decision 015): that record
    says 'counted': false and carries the number the next run uses too. So of two runs
    with one attempt number, the earlier was given back (the uncounted records) and the
    later is charged with the counted ones."""
    same = [run for run in runs if run.attempt == execution.attempt]
    at = [e for e in errors if e["attempt"] == execution.attempt]
    uncounted = frozenset(e["type"] for e in at if e.get("counted") is False)
    counted = frozenset(e["type"] for e in at if e.get("counted") is not False)
    if uncounted and execution is not same[-1]:
        return uncounted
    return counted or uncounted


def test_a_run_given_back_and_its_rerun_are_judged_by_their_own_records() -> None:
    """The judge's own logic, on the records a claimed-ahead job leaves when its worker
    is SIGKILLed just as it starts: attempt 2 given back (uncounted WorkerLost), run
    again as attempt 2 by another worker, which fails by design. (Charging the rerun
    with WorkerLost too made the sigkill scenario fail now and then.)"""
    at = datetime(2026, 12, 1)
    killed = Execution(1, 2, 101, DOOMED_TASK, at, None)
    rerun = Execution(1, 2, 202, DOOMED_TASK, at.replace(second=1), at.replace(second=2))
    runs = [killed, rerun]
    errors = [
        {"attempt": 1, "type": DESIGNED_FAILURE},
        {"attempt": 2, "type": "WorkerLost", "counted": False},
        {"attempt": 2, "type": DESIGNED_FAILURE},
    ]
    assert rerun_reasons(killed, runs, errors) == {"WorkerLost"}
    assert rerun_reasons(rerun, runs, errors) == {DESIGNED_FAILURE}
    # An ordinary counted rescue still explains the run it interrupted.
    only = Execution(2, 1, 101, "chaos.short", at, None)
    assert rerun_reasons(only, [only], [{"attempt": 1, "type": "WorkerLost"}]) == {"WorkerLost"}


def recovery_seconds(verdict: Verdict, kills: list[Event]) -> list[float]:
    """For each attempt a SIGKILLed worker had started and lost (WorkerLost), seconds from
    the kill to the job's next execution, in another process."""
    killed_at = {e.pid: e.at for e in kills}
    times = []
    for execution, reasons in verdict.superseded:
        at = killed_at.get(execution.pid)
        if at is None or "WorkerLost" not in reasons or execution.started > at:
            continue
        runs = sorted(verdict.executions[execution.job_id], key=lambda e: (e.attempt, e.started))
        later = runs[runs.index(execution) + 1 :]
        if later:  # none when the rescue used the job's last attempt (a doomed job)
            times.append((later[0].started - at).total_seconds())
    return times


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def scenario_figures(
    name: str, verdict: Verdict, fleet: Fleet, seed: int, mix: str = "short"
) -> dict[str, Any]:
    events = Counter(e.kind for e in fleet.events if e.kind != "start")
    return {
        "scenario": name,
        "mix": mix,
        **verdict.figures(),
        "events": dict(events),
        "refused_in_logs": fleet.count_in_logs("refused stale outcome"),
        "seed": seed,
    }


def registered_pids(db: ChaosDatabase) -> set[int]:
    return {int(r[0]) for r in db.conn.execute(f"SELECT pid FROM {SCHEMA}.workers")}


def registered_choice(db: ChaosDatabase, fleet: Fleet, rng: random.Random) -> WorkerProcess | None:
    """A random live, registered worker, or None while fewer than two are registered: the
    last worker standing is not killed. On a loaded machine (the test command runs this
    beside other tests) a worker can take longer to start than the kills' interval, and
    killing each one as it registers would leave none running (seen: 200 jobs left, no
    worker up, after 90 s)."""
    candidates = sorted(fleet.registered(db.conn) - fleet.ended)
    return fleet.by_pid(rng.choice(candidates)) if len(candidates) >= 2 else None


# -- the scenarios --------------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT)
def test_calm_drain_runs_every_job_once(chaos_db: ChaosDatabase, fleet: Fleet, seed: int) -> None:
    """The baseline: the same work without chaos, for throughput and for the checks'
    own sake (no re-runs at all)."""
    fleet.start_many(WORKERS, chaos_db.conn, concurrency=CONCURRENCY)
    ids = enqueue(chaos_db, make_jobs(JOBS, random.Random(seed)))
    drain(chaos_db, fleet)

    verdict = judge(chaos_db, ids)
    verdict.assert_sound(allowed=set(), culprits={})
    assert verdict.reruns == Counter()
    assert verdict.dead == JOBS // DOOMED_EVERY
    record_figures(scenario_figures("calm", verdict, fleet, seed))


@pytest.mark.timeout(TIMEOUT)
def test_sigkill_every_second_loses_nothing_and_reruns_only_what_the_dead_held(
    chaos_db: ChaosDatabase, fleet: Fleet, seed: int
) -> None:
    rng = random.Random(seed)
    fleet.start_many(WORKERS, chaos_db.conn, concurrency=CONCURRENCY)
    ids = enqueue(chaos_db, make_jobs(JOBS, rng))

    def kill_one() -> None:
        victim = registered_choice(chaos_db, fleet, rng)
        if victim is not None:
            fleet.kill(victim)
            fleet.start(concurrency=CONCURRENCY)

    drain(chaos_db, fleet, kill_one, every=1.0)

    verdict = judge(chaos_db, ids)
    # Liveness, not the 30 s lease, gave the jobs back: WorkerLost, and only for the dead.
    verdict.assert_sound(allowed={"WorkerLost"}, culprits={"WorkerLost": fleet.pids("kill")})
    kills = [e for e in fleet.events if e.kind == "kill"]
    recovery = recovery_seconds(verdict, kills)
    assert kills, "the queue drained before the first kill"
    assert recovery, "no kill hit a job in its handler; the scenario proved nothing"
    # The rescuer dropped the registrations of the dead.
    wait_until(
        lambda: registered_pids(chaos_db) <= {w.pid for w in fleet.alive()},
        30,
        interval=POLL,
        what="the dead workers' registrations to go",
    )
    figures = scenario_figures("sigkill", verdict, fleet, seed)
    figures.update(
        rerun_after_kill_median_s=statistics.median(recovery),
        rerun_after_kill_p90_s=percentile(recovery, 0.9),
        rerun_after_kill_max_s=max(recovery),
        killed_in_flight=len(recovery),
    )
    record_figures(figures)


def terminate_connections(db: ChaosDatabase, fleet: Fleet, rng: random.Random) -> None:
    """pg_terminate_backend on some or all connections of one random worker."""
    victim = registered_choice(db, fleet, rng)
    if victim is None:
        return
    rows = db.conn.execute(
        """
        SELECT a.pid,
               EXISTS (SELECT 1 FROM pg_locks AS l
                       WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted)
        FROM pg_stat_activity AS a
        WHERE a.datname = current_database() AND a.application_name = %s
          AND a.pid <> pg_backend_pid()
        """,
        (victim.appname,),
    ).fetchall()
    if not rows:
        return
    chosen = rows if rng.random() < 0.5 else rng.sample(rows, rng.randint(1, len(rows)))
    listener = " with the listener" if any(holds for _, holds in chosen) else ""
    fleet.record("terminate", victim.pid, f"{len(chosen)} of {len(rows)}{listener}")
    db.conn.execute(
        "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
        ([int(pid) for pid, _ in chosen],),
    )


@pytest.mark.timeout(TIMEOUT)
def test_terminated_connections_are_reopened_and_nothing_is_lost(
    chaos_db: ChaosDatabase, fleet: Fleet, seed: int
) -> None:
    rng = random.Random(seed)
    # A claim whose reply is lost with its connection leaves jobs running under a worker
    # that does not know them; its next heartbeat gives them back (Reconciled), every
    # third of the lease, so keep it short.
    options: dict[str, Any] = {"concurrency": CONCURRENCY, "lease": 5.0}
    fleet.start_many(WORKERS, chaos_db.conn, **options)
    ids = enqueue(chaos_db, make_jobs(JOBS, rng))

    drain(chaos_db, fleet, lambda: terminate_connections(chaos_db, fleet, rng), every=0.5)

    verdict = judge(chaos_db, ids)
    # A live worker whose listener was cut looks dead for a moment (WorkerLost); a lease
    # lost is its own justification.
    cut = fleet.pids("terminate")
    verdict.assert_sound(
        allowed={"WorkerLost", "LeaseExpired", "Reconciled"},
        culprits={"WorkerLost": cut, "Reconciled": cut},
    )
    assert all(w.alive for w in fleet.workers), "no worker may die of a lost connection"
    assert fleet.pids("terminate"), "the queue drained before the first termination"
    figures = scenario_figures("terminate", verdict, fleet, seed)
    figures["listener_cuts"] = sum("listener" in e.detail for e in fleet.events)
    record_figures(figures)


def liveness_holders(db: ChaosDatabase) -> set[str]:
    """application_name of every connection holding an advisory lock: each worker's
    listener, which takes its liveness lock right after LISTEN on the same connection."""
    rows = db.conn.execute(
        """
        SELECT a.application_name FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)
        WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database()
        """
    ).fetchall()
    return {str(r[0]) for r in rows}


def completed(db: ChaosDatabase, ids: list[int]) -> bool:
    count = db.scalar(f"SELECT count(*) FROM {SCHEMA}.job_history WHERE id = ANY(%s)", (ids,))
    return int(count) == len(ids)


DOWNTIME = 2.0
LOST_CLAIM = "ClaimLostInCrash"


def crash_after(
    server: PrivateServer, db: ChaosDatabase, fleet: Fleet, finished: int
) -> tuple[datetime, datetime]:
    """Once ``finished`` jobs are in history, crash the server (every worker's sessions
    cut, recorded), keep it down for DOWNTIME, start it and reconnect ``db``. Returns
    when it went down and when it was back."""
    wait_until(
        lambda: db.scalar(f"SELECT count(*) FROM {SCHEMA}.job_history") >= finished,
        DRAIN_DEADLINE,
        interval=POLL,
        what=f"{finished} jobs to complete",
        check=fleet.check,
    )
    for worker in fleet.workers:
        fleet.record("cut", worker.pid, "server stop")
    crashed_at = utcnow()
    server.crash()
    time.sleep(DOWNTIME)  # the outage's length: the chaos's schedule, not a wait
    fleet.check()
    server.start()
    restarted_at = utcnow()
    db.reconnect()
    return crashed_at, restarted_at


def explain_lost_claims(verdict: Verdict, crashed_at: datetime) -> int:
    """Workers commit claims with synchronous_commit off (decision 009): a crash may undo
    the last of them, and those jobs run again under the same attempt with nothing
    recorded on the job. Name that reason where it is the only one that fits: an attempt
    run again, under the same number, by a run that started after the crash. The first
    run may itself have started after the crash: handlers go on starting until the crash
    has taken effect, and a job claimed ahead (decision 018) waits in its worker for a
    slot across the outage and starts once one frees. Return how many."""
    count = 0
    for index, (execution, reasons) in enumerate(verdict.superseded):
        if reasons:
            continue
        again = [
            e
            for e in verdict.executions[execution.job_id]
            if e.attempt == execution.attempt
            and e.started >= crashed_at
            and e.started > execution.started
        ]
        if again:
            verdict.superseded[index] = (execution, frozenset({LOST_CLAIM}))
            count += 1
    return count


@pytest.mark.timeout(TIMEOUT)
def test_a_server_restart_mid_drain_is_ridden_out(
    private_db: tuple[PrivateServer, ChaosDatabase],
    fleet_factory: Callable[[str], Fleet],
    seed: int,
) -> None:
    server, db = private_db
    fleet = fleet_factory(db.url)
    # A poll interval far longer than the test's patience for the last probe: only a
    # notification, so a listener that listens again, can make that probe run in time.
    options: dict[str, Any] = {"concurrency": CONCURRENCY, "lease": 6.0, "poll_interval": 30.0}
    fleet.start_many(WORKERS, db.conn, **options)
    ids = enqueue(db, make_jobs(JOBS, random.Random(seed)))
    crashed_at, restarted_at = crash_after(server, db, fleet, JOBS // 3)
    # Lose the registry too, as a rescuer that took every worker for dead would: each must
    # register again by itself.
    db.conn.execute(f"DELETE FROM {SCHEMA}.workers")
    drain(db, fleet)

    verdict = judge(db, ids)
    lost_claims = explain_lost_claims(verdict, crashed_at)
    pids = {w.pid for w in fleet.workers}
    verdict.assert_sound(
        allowed={"WorkerLost", "LeaseExpired", "Reconciled", LOST_CLAIM},
        culprits={"WorkerLost": pids},
    )
    assert len(fleet.workers) == WORKERS and all(w.alive for w in fleet.workers)
    for worker in fleet.workers:
        assert "listener connection lost" in worker.log(), worker.log()[-3000:]
    # Each worker registered again and holds its liveness lock on a new LISTEN connection.
    wait_until(lambda: fleet.registered(db.conn) == pids, 30, interval=POLL, what="re-registration")
    appnames = {w.appname for w in fleet.workers}
    wait_until(lambda: liveness_holders(db) == appnames, 30, interval=POLL, what="liveness locks")
    probe = enqueue(db, [work_async.job(ms=1) for _ in range(WORKERS)])
    wait_until(
        lambda: completed(db, probe), 10, interval=POLL, what="a notified probe", check=fleet.check
    )

    # finished_at is its transaction's start, so this one began after the server was back.
    first_completion = db.scalar(
        f"SELECT min(finished_at) FROM {SCHEMA}.job_history WHERE finished_at > %s",
        (restarted_at,),
    )
    figures = scenario_figures("restart", verdict, fleet, seed)
    figures["claims_lost_in_crash"] = lost_claims
    figures["server_down_s"] = (restarted_at - crashed_at).total_seconds()
    figures["completing_again_after_start_s"] = (first_completion - restarted_at).total_seconds()
    record_figures(figures)


def running_sync_pids(db: ChaosDatabase) -> list[int]:
    """Workers with a sync handler mid-sleep on a job they still hold."""
    rows = db.conn.execute(
        f"""
        SELECT DISTINCT e.pid FROM chaos_executions AS e
        JOIN {SCHEMA}.jobs AS j ON j.id = e.job_id AND j.attempts = e.attempt
        WHERE j.state = 'running' AND e.finished_at IS NULL AND e.task = %s
        """,
        (SYNC_TASK,),
    ).fetchall()
    return [int(r[0]) for r in rows]


def held_by(db: ChaosDatabase, pid: int) -> list[tuple[Any, ...]]:
    """Jobs the worker still holds, or whose attempt it started and that nobody has re-run
    or completed yet: (job id, attempt, state, holder, errors) of each."""
    return db.conn.execute(
        f"""
        SELECT j.id, j.attempts, j.state, j.worker_id, j.errors
        FROM {SCHEMA}.jobs AS j
        WHERE j.worker_id IN (SELECT id FROM {SCHEMA}.workers WHERE pid = %(pid)s)
           OR j.id IN (
               SELECT e.job_id FROM chaos_executions AS e
               WHERE e.pid = %(pid)s AND e.task <> %(doomed)s
                 AND NOT EXISTS (SELECT 1 FROM {SCHEMA}.job_history AS h
                                 WHERE h.id = e.job_id AND h.attempts = e.attempt)
                 AND NOT EXISTS (SELECT 1 FROM chaos_executions AS n
                                 WHERE n.job_id = e.job_id AND n.attempt > e.attempt))
        """,
        {"pid": pid, "doomed": DOOMED_TASK},
    ).fetchall()


def backend_states(db: ChaosDatabase, appname: str) -> list[tuple[str, str | None]]:
    """(state, wait event) of each connection of the worker named ``appname``."""
    rows = db.conn.execute(
        "SELECT state, wait_event FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (appname,),
    ).fetchall()
    return [(str(state), event) for state, event in rows]


def pause_outside_transactions(
    db: ChaosDatabase, fleet: Fleet, victim: WorkerProcess, rng: random.Random
) -> None:
    """SIGSTOP the victim at a moment none of its connections is inside a transaction.

    A worker stopped inside its completion transaction holds row locks that block every
    rescue (test_one_locked_expired_job_does_not_stop_every_rescue pins that bug); this
    scenario is about the lease, so it lets such a moment pass and stops the worker again.
    """
    for _ in range(100):
        fleet.send(victim, signal.SIGSTOP, "stop")
        # Statements already sent run to their end without the client (unless the server
        # waits to write to it); then an open transaction shows as idle in transaction,
        # or, for a pipeline the client had not finished sending (the completer's flush),
        # as active and waiting to read from the client.
        wait_until(
            lambda: all(
                s != "active" or e in ("ClientWrite", "ClientRead")
                for s, e in backend_states(db, victim.appname)
            ),
            STARTUP_TIMEOUT,
            what="the stopped worker's statements to finish",
        )
        if not any(
            s == "idle in transaction" or (s == "active" and e == "ClientRead")
            for s, e in backend_states(db, victim.appname)
        ):
            return
        fleet.send(victim, signal.SIGCONT, "cont")
        time.sleep(rng.uniform(0.005, 0.05))  # the chaos's schedule: try again a moment later
    raise AssertionError("the worker was inside a transaction at every try")


@pytest.mark.timeout(TIMEOUT)
def test_a_worker_stopped_past_its_lease_cannot_complete_what_it_lost(
    chaos_db: ChaosDatabase, fleet: Fleet, seed: int
) -> None:
    rng = random.Random(seed)
    # Without the liveness lock the stopped worker's open connections keep nothing alive:
    # only its lease protects its jobs, and that runs out in 2 s.
    options: dict[str, Any] = {"concurrency": CONCURRENCY, "lease": 2.0, "liveness_lock": False}
    fleet.start_many(WORKERS, chaos_db.conn, **options)
    ids = enqueue(chaos_db, make_jobs(JOBS, rng))

    busy = wait_until(
        lambda: running_sync_pids(chaos_db),
        30,
        interval=POLL,
        what="sync work in flight",
        check=fleet.check,
    )
    victim = fleet.by_pid(rng.choice(busy))
    pause_outside_transactions(chaos_db, fleet, victim, rng)
    try:
        wait_until(
            lambda: not held_by(chaos_db, victim.pid),
            60,
            interval=POLL,
            what="the stopped worker's jobs to be rescued and run elsewhere",
            check=fleet.check,
        )
    except AssertionError as exc:
        held = held_by(chaos_db, victim.pid)
        raise AssertionError(f"{exc}: {held}\n{diagnose(chaos_db, fleet)}") from None
    resumed = fleet.send(victim, signal.SIGCONT, "cont")
    drain(chaos_db, fleet)

    verdict = judge(chaos_db, ids)
    verdict.assert_sound(allowed={"LeaseExpired"}, culprits={})
    stale = [
        e for e, reasons in verdict.superseded if e.pid == victim.pid and "LeaseExpired" in reasons
    ]
    assert stale, "the stopped worker lost no job"
    # Recorded but not accepted: its handlers ran on after SIGCONT, and what they reported
    # was refused by the fence, or dropped with the lease its heartbeat found gone.
    late = [e for e in stale if e.finished is not None and e.finished > resumed.at]
    assert late, "no handler of the stopped worker finished after it was resumed"

    def unanswered() -> list[Execution]:
        log = victim.log()
        return [
            e
            for e in late
            if f"refused stale outcome for job {e.job_id} attempt {e.attempt}" not in log
            and f"lost the lease of job {e.job_id} attempt {e.attempt}" not in log
        ]

    try:
        wait_until(
            lambda: not unanswered(), 30, interval=POLL, what="the stale attempts to be refused"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {unanswered()}\n{victim.log()[-3000:]}") from None
    assert victim.alive
    figures = scenario_figures("sigstop", verdict, fleet, seed)
    figures.update(stale_executions=len(stale), late_completions=len(late))
    record_figures(figures)


@pytest.mark.timeout(TIMEOUT)
def test_sigterm_mid_work_finishes_or_releases_and_exits_zero(
    chaos_db: ChaosDatabase, fleet: Fleet, seed: int
) -> None:
    rng = random.Random(seed)
    options: dict[str, Any] = {"concurrency": CONCURRENCY, "shutdown_timeout": 1.0}
    fleet.start_many(WORKERS, chaos_db.conn, **options)
    # Some jobs outlast the shutdown timeout, so both endings of a graceful stop happen.
    ids = enqueue(chaos_db, make_jobs(JOBS, rng, long_share=0.03, long_ms=2500))
    signalled: list[Event] = []

    def term_one() -> None:
        victim = registered_choice(chaos_db, fleet, rng)
        if victim is not None:
            signalled.append(fleet.send(victim, signal.SIGTERM, "term"))
            fleet.start(**options)

    drain(chaos_db, fleet, term_one, every=1.5)

    assert signalled, "the queue drained before the first SIGTERM"
    for event in signalled:
        worker = fleet.by_pid(event.pid)
        assert worker.exit_code(EXIT_TIMEOUT) == 0, worker.log()[-4000:]
    verdict = judge(chaos_db, ids)
    termed = fleet.pids("term")
    verdict.assert_sound(allowed={"WorkerShutdown"}, culprits={"WorkerShutdown": termed})
    gone = chaos_db.conn.execute(
        f"SELECT pid FROM {SCHEMA}.workers WHERE pid = ANY(%s)", (list(termed),)
    ).fetchall()
    assert gone == [], "a stopped worker left its registration behind"
    # In flight at the signal: finished in the grace period, or released to run again.
    term_at = {e.pid: e.at for e in signalled}
    finished_in_grace = sum(
        1
        for runs in verdict.executions.values()
        for e in runs
        if e.pid in term_at
        and e.started <= term_at[e.pid]
        and e.finished is not None
        and e.finished > term_at[e.pid]
    )
    released = sum(1 for e, reasons in verdict.superseded if "WorkerShutdown" in reasons)
    assert finished_in_grace > 0
    assert released > 0
    figures = scenario_figures("sigterm", verdict, fleet, seed, mix="3% long")
    figures.update(finished_in_grace=finished_in_grace, released=released)
    record_figures(figures)


def test_a_stop_landing_while_a_claim_is_read_strands_no_job(
    chaos_db: ChaosDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window the sigterm scenario used to hit now and then (silent LeaseExpired
    rescues of attempts nobody ran, until b04f623), made certain: the stop arrives just
    after a claim's rows came back. The claimed job must run, or be released."""
    local = skiplock.App(chaos_db.url, schema=SCHEMA)

    @local.task(name="chaos.idle", queue="strand")
    async def idle() -> None: ...

    worker = skiplock.Worker(local, queues=["strand"], concurrency=2, shutdown_timeout=1.0)
    original = psycopg.AsyncCursor.fetchall

    async def fetchall_then_stop(self: psycopg.AsyncCursor[Any]) -> list[Any]:
        rows = await original(self)
        columns = {c.name for c in self.description or []}
        if rows and {"args", "max_attempts"} <= columns:  # a claim's reply
            worker.request_stop()
            await asyncio.sleep(0.5)  # the stop lands here, as if the reply were slow
        return rows

    monkeypatch.setattr(psycopg.AsyncCursor, "fetchall", fetchall_then_stop)
    with chaos_db.conn.transaction():
        job = int(idle.enqueue(chaos_db.conn))
    handle = WorkerThread(worker)
    try:
        handle.start()
        handle.join()
    finally:
        worker.request_stop()  # if the claim never came, do not leave the thread running

    row = chaos_db.conn.execute(
        f"SELECT state, worker_id FROM {SCHEMA}.jobs WHERE id = %s", (job,)
    ).fetchone()
    ran = completed(chaos_db, [job])
    assert ran or row == ("available", None), f"left {row} by worker {worker.id}"


@pytest.mark.timeout(TIMEOUT)
def test_one_locked_expired_job_does_not_stop_every_rescue(
    chaos_db: ChaosDatabase, fleet: Fleet
) -> None:
    """What the sigstop scenario avoids (see pause_outside_transactions), made certain: a
    hung worker's completion transaction, stopped before its COMMIT, still holds the row
    of one of its jobs; its other job must be rescued and run all the same."""
    conn = chaos_db.conn
    hung = uuid.uuid4()
    rows = conn.execute(
        f"""
        INSERT INTO {SCHEMA}.jobs (queue, task, args, state, attempts, max_attempts,
                                   worker_id, lease_expires_at, attempted_at)
        SELECT %s, %s, '{{"ms": 1}}', 'running', 1, 5, %s,
               now() - interval '1 minute', now() - interval '2 minutes'
        FROM generate_series(1, 2)
        RETURNING id
        """,
        (QUEUE, ASYNC_TASK, hung),
    ).fetchall()
    locked, other = (int(r[0]) for r in rows)
    with psycopg.connect(chaos_db.url) as paused:
        # The completer's DELETE, sent; its COMMIT never is.
        paused.execute(f"DELETE FROM {SCHEMA}.jobs WHERE id = %s", (locked,))
        fleet.start_many(1, conn, concurrency=CONCURRENCY, lease=2.0)
        try:
            wait_until(
                lambda: completed(chaos_db, [other]),
                10,
                interval=POLL,
                what="the unlocked expired job to be rescued and run",
                check=fleet.check,
            )
        finally:
            paused.rollback()
