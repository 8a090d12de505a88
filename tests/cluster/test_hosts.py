"""Workers on three hosts (network namespaces, harness.py) against one PostgreSQL.

Two worker processes per host drain the chaos suite's jobs (tests/chaos/chaos_app.py
records every execution) while the test cuts one host's link or freezes all its workers;
the chaos suite's judge says whether every job ran to its designed end exactly once, with
no stale outcome accepted and every re-run explained by a rescue of the host the test
acted on.

The host acted on is the leader's: the worst case, since the rescuer itself is then among
the lost. Figures: the time from the cut (or freeze) until the server dropped the host's
sessions, until none of its jobs was held any more, and until each of them started again
elsewhere.
"""

from __future__ import annotations

import random
import re
import signal
import statistics
import time
from collections import Counter
from typing import Any

import pytest

from chaos.conftest import SCHEMA, ChaosDatabase
from chaos.test_chaos import (
    DOOMED_EVERY,
    Execution,
    Verdict,
    diagnose,
    drain,
    enqueue,
    judge,
    make_jobs,
    pause_outside_transactions,
    percentile,
    running_sync_pids,
)
from conftest import wait_until
from skiplock.bench.topology import run

from .conftest import JOBS, OUTAGE, record_figures
from .harness import HOSTS, HostFleet

PER_HOST = 2
CONCURRENCY = 8
POLL = 0.05
DRAIN_DEADLINE = 90.0 + JOBS / 40
TIMEOUT = 240.0 + JOBS / 20
# Long enough that a cut host's jobs can only come back by the server noticing its dead
# sessions (liveness, decision 014), not by their lease running out during the outage.
CUT_LEASE = 60.0
# A frozen host's kernel still answers for it: its sessions live, only leases run out.
FREEZE_LEASE = 4.0
# The workers' own bound on a silent peer (keepalives and tcp_user_timeout, seconds).
TCP_USER_TIMEOUT = 4.0
RESCUE_PATIENCE = 90.0
ACTED_ON = {"WorkerLost", "LeaseExpired", "Reconciled"}


@pytest.fixture
def seed() -> int:
    return random.randrange(2**32)


def leader_pid(db: ChaosDatabase) -> int | None:
    row = db.conn.execute(
        f"SELECT w.pid FROM {SCHEMA}.leader AS l JOIN {SCHEMA}.workers AS w"
        " ON w.id = l.worker_id AND l.expires_at > now()"
    ).fetchone()
    return None if row is None else int(row[0])


def worker_ids(db: ChaosDatabase, pids: set[int]) -> list[str]:
    rows = db.conn.execute(
        f"SELECT id::text FROM {SCHEMA}.workers WHERE pid = ANY(%s)", (list(pids),)
    ).fetchall()
    return [str(r[0]) for r in rows]


def held(db: ChaosDatabase, ids: list[str]) -> int:
    """Jobs still claimed by these workers (running or claimed ahead)."""
    return int(
        db.scalar(
            f"SELECT count(*) FROM {SCHEMA}.jobs WHERE state = 'running'"
            " AND worker_id = ANY(%s::uuid[])",
            (ids,),
        )
    )


def sessions_from(db: ChaosDatabase, address: str) -> int:
    return int(
        db.scalar("SELECT count(*) FROM pg_stat_activity WHERE client_addr = %s::inet", (address,))
    )


def busy_leader_host(db: ChaosDatabase, fleet: HostFleet) -> str:
    """The leader's host, once one of its workers has a sync handler mid-job."""

    def ready() -> str | None:
        pid = leader_pid(db)
        if pid is None or pid not in fleet.host_of:
            return None
        host = fleet.host_of[pid]
        mine = {w.pid for w in fleet.on_host(host)}
        return host if mine & set(running_sync_pids(db)) else None

    host = wait_until(
        ready, 60, interval=POLL, what="a leader with work in flight", check=fleet.check
    )
    assert host is not None
    return host


def rescue_seconds(verdict: Verdict, pids: set[int], since: float) -> list[float]:
    """For each attempt of ``pids`` started before ``since`` (epoch seconds) and lost to
    a rescue, seconds from ``since`` to the job's next execution by another process."""
    times = []
    for execution, reasons in verdict.superseded:
        if execution.pid not in pids or not reasons & ACTED_ON:
            continue
        if execution.started.timestamp() > since:
            continue
        runs = sorted(verdict.executions[execution.job_id], key=lambda e: (e.attempt, e.started))
        later = [e for e in runs[runs.index(execution) + 1 :] if e.pid not in pids]
        if later:
            times.append(later[0].started.timestamp() - since)
    return times


def refused(fleet: HostFleet, late: list[Execution]) -> list[Execution]:
    """The late executions whose outcome its worker has not (yet) logged as refused by
    the fence or dropped with a lease found lost."""
    logs = "".join(fleet.by_pid(pid).log() for pid in {e.pid for e in late})
    return [
        e
        for e in late
        if f"refused stale outcome for job {e.job_id} attempt {e.attempt}" not in logs
        and f"lost the lease of job {e.job_id} attempt {e.attempt}" not in logs
    ]


def spread(verdict: Verdict, fleet: HostFleet) -> dict[str, int]:
    counts = Counter(fleet.host_of[e.pid] for runs in verdict.executions.values() for e in runs)
    return dict(sorted(counts.items()))


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {}
    return {
        "rerun_median_s": round(statistics.median(values), 2),
        "rerun_p90_s": round(percentile(values, 0.9) or 0.0, 2),
        "rerun_max_s": round(max(values), 2),
        "reruns_measured": len(values),
    }


@pytest.mark.timeout(TIMEOUT)
def test_three_hosts_drain_every_job_exactly_once(
    cluster_db: ChaosDatabase, hosts: HostFleet, seed: int
) -> None:
    hosts.start_hosts(PER_HOST, cluster_db.conn, concurrency=CONCURRENCY)
    ids = enqueue(cluster_db, make_jobs(JOBS, random.Random(seed)))
    drain(cluster_db, hosts, deadline=DRAIN_DEADLINE)

    verdict = judge(cluster_db, ids)
    verdict.assert_sound(allowed=set(), culprits={})
    assert verdict.reruns == Counter()
    assert verdict.dead == JOBS // DOOMED_EVERY
    ran = spread(verdict, hosts)
    assert set(ran) == set(HOSTS), f"not every host ran jobs: {ran}"
    record_figures(
        {"scenario": "hosts", **verdict.figures(), "executions_per_host": ran, "seed": seed}
    )


# A job claimed ahead (decision 018) that waits in the cut host's worker for a slot is
# given back by the rescue as never started, and run again elsewhere under the same attempt
# number. When the link returns, the slots free up (the handlers blocked on the database
# finish). Before the worker read such a job's claim after a silence (worker/leased.py,
# CONFIRM_AFTER_SILENCE), it started the job too: run twice, completed once (3 runs in 4
# at 1,500 jobs). Both variants must now be clean.
@pytest.mark.timeout(TIMEOUT + OUTAGE)
@pytest.mark.parametrize("prefetch", ["0", "auto"])
def test_a_host_cut_off_mid_drain_is_rescued_and_its_late_outcomes_refused(
    cluster_db: ChaosDatabase, hosts: HostFleet, seed: int, prefetch: str
) -> None:
    db = cluster_db
    network = hosts.cluster.network
    hosts.start_hosts(
        PER_HOST,
        db.conn,
        concurrency=CONCURRENCY,
        lease=CUT_LEASE,
        tcp_user_timeout=TCP_USER_TIMEOUT,
        prefetch=prefetch,
    )
    # Some long sync jobs, so handlers are mid-job at the cut and finish while cut off.
    ids = enqueue(db, make_jobs(JOBS, random.Random(seed), long_share=0.05, long_ms=3000))
    victim = busy_leader_host(db, hosts)
    pids = {w.pid for w in hosts.on_host(victim)}
    mine = worker_ids(db, pids)
    address = network.address(victim)

    for pid in sorted(pids):
        hosts.record("cut", pid, f"link of {victim} down")
    cut_at = time.time()
    network.cut(victim)
    try:
        wait_until(
            lambda: sessions_from(db, address) == 0,
            RESCUE_PATIENCE,
            interval=POLL,
            what=f"the server to drop {victim}'s sessions",
            check=hosts.check,
        )
        sessions_dropped_s = time.time() - cut_at
        try:
            wait_until(
                lambda: held(db, mine) == 0,
                RESCUE_PATIENCE,
                interval=POLL,
                what=f"{victim}'s jobs to be rescued",
                check=hosts.check,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{diagnose(db, hosts)}") from None
        released_s = time.time() - cut_at
        # The outage's length: the chaos's schedule, not a wait for an outcome.
        time.sleep(max(0.0, OUTAGE - (time.time() - cut_at)))
    finally:
        network.restore(victim)
    restored_at = time.time()
    drain(db, hosts, deadline=DRAIN_DEADLINE)

    verdict = judge(db, ids)
    verdict.assert_sound(allowed=ACTED_ON, culprits={"WorkerLost": pids, "LeaseExpired": pids})
    stale = [e for e, reasons in verdict.superseded if e.pid in pids and reasons & ACTED_ON]
    assert stale, f"{victim} lost no job to a rescue"
    reruns = rescue_seconds(verdict, pids, cut_at)
    assert reruns, f"no job {victim} held at the cut ran again elsewhere"
    # Handlers of the cut host that ran to their end reported to a worker whose claim was
    # gone: each outcome is refused by the fence or dropped with the lost lease.
    late = [e for e in stale if e.finished is not None]
    try:
        wait_until(
            lambda: not refused(hosts, late), 60, interval=POLL, what="the late outcomes refused"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {refused(hosts, late)}") from None
    # The host's workers outlived the outage and serve again.
    wait_until(
        lambda: pids <= hosts.registered(db.conn),
        60,
        interval=POLL,
        what=f"{victim}'s workers to register again",
        check=hosts.check,
    )
    record_figures(
        {
            "scenario": f"cut (prefetch {prefetch})",
            **verdict.figures(),
            "outage_s": round(restored_at - cut_at, 2),
            "sessions_dropped_s": round(sessions_dropped_s, 2),
            "jobs_released_s": round(released_s, 2),
            **summary(reruns),
            "stale_executions": len(stale),
            "late_outcomes_refused": len(late),
            "lease_s": CUT_LEASE,
            "executions_per_host": spread(verdict, hosts),
            "seed": seed,
        }
    )


@pytest.mark.timeout(TIMEOUT + OUTAGE)
def test_a_frozen_host_is_rescued_and_its_late_outcomes_refused_after_the_thaw(
    cluster_db: ChaosDatabase, hosts: HostFleet, seed: int
) -> None:
    db = cluster_db
    rng = random.Random(seed)
    hosts.start_hosts(PER_HOST, db.conn, concurrency=CONCURRENCY, lease=FREEZE_LEASE)
    ids = enqueue(db, make_jobs(JOBS, rng, long_share=0.05, long_ms=2500))
    victim = busy_leader_host(db, hosts)
    frozen = hosts.on_host(victim)
    pids = {w.pid for w in frozen}
    mine = worker_ids(db, pids)

    # Each stopped outside a transaction: a row lock held by a stopped process would keep
    # that one job from its rescue (the chaos suite's sigstop scenario says more).
    for worker in frozen:
        pause_outside_transactions(db, hosts, worker, rng)
    frozen_at = max(e.at for e in hosts.events if e.kind == "stop").timestamp()
    try:
        wait_until(
            lambda: held(db, mine) == 0,
            RESCUE_PATIENCE,
            interval=POLL,
            what=f"{victim}'s jobs to be rescued",
            check=hosts.check,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnose(db, hosts)}") from None
    released_s = time.time() - frozen_at
    time.sleep(max(0.0, OUTAGE - (time.time() - frozen_at)))  # the freeze's length
    resumed = [hosts.send(worker, signal.SIGCONT, "cont") for worker in frozen]
    thawed_at = max(e.at for e in resumed)
    drain(db, hosts, deadline=DRAIN_DEADLINE)

    verdict = judge(db, ids)
    # Leases of 4 s may also run out on a busy machine for a worker nobody froze.
    verdict.assert_sound(allowed=ACTED_ON, culprits={"WorkerLost": pids})
    stale = [e for e, reasons in verdict.superseded if e.pid in pids and reasons & ACTED_ON]
    assert stale, f"{victim} lost no job to a rescue"
    reruns = rescue_seconds(verdict, pids, frozen_at)
    assert reruns, f"no job {victim} held at the freeze ran again elsewhere"
    late = [e for e in stale if e.finished is not None and e.finished > thawed_at]
    assert late, f"no handler on {victim} finished after the thaw"
    try:
        wait_until(
            lambda: not refused(hosts, late), 60, interval=POLL, what="the late outcomes refused"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {refused(hosts, late)}") from None
    assert all(w.alive for w in frozen)
    record_figures(
        {
            "scenario": "freeze",
            **verdict.figures(),
            "frozen_s": round(thawed_at.timestamp() - frozen_at, 2),
            "jobs_released_s": round(released_s, 2),
            **summary(reruns),
            "stale_executions": len(stale),
            "late_outcomes_refused": len(late),
            "lease_s": FREEZE_LEASE,
            "executions_per_host": spread(verdict, hosts),
            "seed": seed,
        }
    )


def keepalive_timers(fleet: HostFleet, db: ChaosDatabase, host: str) -> dict[int, str]:
    """For each session of ``host`` that holds a liveness lock (the worker's own, not its
    handlers'), the time left to its socket's next keepalive probe, as ``ss -o`` shows it
    ("117min" with the system's default idle of two hours). Sockets with data in flight
    (a retransmission timer instead) are left out."""
    address = fleet.cluster.network.address(host)
    rows = db.conn.execute(
        "SELECT DISTINCT a.client_port FROM pg_stat_activity AS a"
        " JOIN pg_locks AS l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted"
        " WHERE a.client_addr = %s::inet",
        (address,),
    ).fetchall()
    ports = {int(r[0]) for r in rows}
    namespace = fleet.cluster.network.namespace(host)
    sockets = run(["ip", "netns", "exec", namespace, "ss", "-tnoH", "state", "established"])
    timers = {}
    for line in sockets.stdout.splitlines():
        local = next(f for f in line.split() if f.startswith(f"{address}:"))
        timer = re.search(r"timer:\(keepalive,([^,]+),", line)
        port = int(local.rsplit(":", 1)[1])
        if port in ports and timer is not None:
            timers[port] = timer.group(1)
    return timers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [4.0, 0.0])
def test_the_workers_own_sessions_probe_a_silent_peer_within_the_timeout(
    cluster_db: ChaosDatabase, hosts: HostFleet, timeout: float
) -> None:
    """Every session the worker opens for itself (listener, heartbeat, pools: those that
    hold its liveness lock) probes its peer after seconds of silence, from
    --tcp-user-timeout; 0 leaves libpq's and the system's default (keepalive on, first
    probe after two hours)."""
    worker = hosts.start_on("h1", concurrency=2, tcp_user_timeout=timeout)
    hosts.wait_registered(cluster_db.conn, [worker])
    timers = wait_until(
        lambda: keepalive_timers(hosts, cluster_db, "h1"),
        30,
        interval=POLL,
        what="the worker's sockets",
    )
    assert len(timers) >= 2, timers  # at least the listener and the heartbeat
    in_minutes = {port for port, left in timers.items() if left.endswith("min")}
    assert in_minutes == (set() if timeout else set(timers)), timers
