"""Chaos, listener cuts: long jobs run while the workers' listeners are cut every 3 s.

Two worker processes drain long jobs (half async, half sync). The listener of one is
ended by the server: ``idle_session_timeout`` of 3 s reaches it through ``PGOPTIONS``,
which only the listener takes (the pools and the heartbeat set options of their own).
The listener of the other is ended by ``pg_terminate_backend`` every 3 s, and each new
one at once for 1.2 s, which today's rescue pass (every second) cannot miss. Whichever
leads rescues every second. A worker whose listener dropped is alive (decision 014), so
no job may start twice, and none is rescued.

Size: at the default ``SKIPLOCK_CHAOS_JOBS`` (the test run), 24 jobs of 5 s on 8 slots,
about 20 s. At any larger size (``scripts/chaos --jobs 5000``) the issue's: 100 jobs of
10 s on 16 slots, so the cuts go on for over 60 s.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from processes import WorkerProcess

from .chaos_app import work_async, work_sync
from .conftest import (
    DEFAULT_JOBS,
    JOBS,
    SCHEMA,
    ChaosDatabase,
    Fleet,
    record_figures,
)
from .test_chaos import drain, enqueue, judge, scenario_figures

pytestmark = pytest.mark.chaos

FULL = JOBS > DEFAULT_JOBS
JOB_COUNT, JOB_MS, CONCURRENCY = (100, 10_000, 8) if FULL else (24, 5_000, 4)
CUT_EVERY = 3.0
IDLE_SESSION_TIMEOUT_MS = 3000
BLIP_SECONDS = 1.2
# The seconds the cuts last at the least: jobs x length / slots.
CUT_SECONDS = JOB_COUNT * JOB_MS / 1000 / (2 * CONCURRENCY)


def worker_id(db: ChaosDatabase, worker: WorkerProcess) -> uuid.UUID:
    return uuid.UUID(
        str(db.scalar(f"SELECT id FROM {SCHEMA}.workers WHERE pid = %s", (worker.pid,)))
    )


def terminate_listener(
    db: ChaosDatabase, fleet: Fleet, worker: WorkerProcess, worker_id: uuid.UUID
) -> None:
    """pg_terminate_backend on the worker's listener (its session is named for it), and on
    each new one for BLIP_SECONDS: a proxy dropping that connection for a moment, longer
    than a rescue pass."""
    name = f"skiplock listener {worker_id}"
    ended = 0
    end = time.monotonic() + BLIP_SECONDS
    while time.monotonic() < end:
        fleet.check()
        rows = db.conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (name,),
        ).fetchall()
        ended += len(rows)  # none while it reconnects
        time.sleep(0.01)  # the chaos's pace, not a wait for an outcome
    if ended:
        fleet.record("terminate", worker.pid, f"{ended} listeners")


@pytest.mark.timeout(240 if FULL else 120)
def test_listener_cuts_never_make_a_running_job_start_twice(
    chaos_db: ChaosDatabase, fleet: Fleet
) -> None:
    # Named by the worker itself (skiplock <purpose> <id>), not by PGAPPNAME.
    unnamed: dict[str, str | None] = {"PGAPPNAME": None}
    options: dict[str, Any] = {"concurrency": CONCURRENCY, "lease": 30.0}
    idle = fleet.start(
        **options,
        extra_env={**unnamed, "PGOPTIONS": f"-c idle_session_timeout={IDLE_SESSION_TIMEOUT_MS}"},
    )
    cut = fleet.start(**options, extra_env=unnamed)
    fleet.wait_registered(chaos_db.conn, [idle, cut])
    specs = [(work_sync if i % 2 else work_async).job(ms=JOB_MS) for i in range(JOB_COUNT)]
    ids = enqueue(chaos_db, specs)

    # A blip starts every CUT_EVERY seconds.
    every = CUT_EVERY - BLIP_SECONDS
    cut_id = worker_id(chaos_db, cut)
    drain(chaos_db, fleet, lambda: terminate_listener(chaos_db, fleet, cut, cut_id), every=every)

    verdict = judge(chaos_db, ids)
    # No reason justifies a re-run here: every execution must be the job's only one.
    verdict.assert_sound(allowed=set(), culprits={})
    assert all(w.alive for w in fleet.workers), "no worker may die of a cut listener"
    idle_cuts = idle.log().count("listener connection lost")
    blips = [e for e in fleet.events if e.kind == "terminate"]
    terminations = sum(int(e.detail.split()[0]) for e in blips)
    expected = int(CUT_SECONDS // CUT_EVERY) - 2
    assert idle_cuts >= expected, f"the idle timeout cut the listener {idle_cuts} times"
    assert len(blips) >= expected, f"the listener was cut off {len(blips)} times"
    # Nor rescued before its handler started (a prefetched or just-claimed job).
    rescued = chaos_db.scalar(f"SELECT count(*) FROM {SCHEMA}.job_history WHERE errors <> '[]'")
    assert rescued == 0, verdict.errors
    figures = scenario_figures("listener cuts", verdict, fleet, seed=0, mix=f"{JOB_MS} ms")
    figures["idle_cuts"] = idle_cuts
    figures["listener_blips"] = len(blips)
    figures["listeners_terminated"] = terminations
    record_figures(figures)
