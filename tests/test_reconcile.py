"""Reconciliation: a job the database says a live worker runs, and that the worker does
not run (its claim's answer or its outcome was lost with a connection, or an
asynchronous failover), is given back by the worker's own heartbeat, long before its
lease ends (docs/failover.md, "Known limits" before issue 20).

The worker tests use a 30 s lease, so the heartbeat beats every 10 s: a job given back by
the lease would take 30 s and more, one given back by the heartbeat at most one beat.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import skiplock
from conftest import SCHEMA, StartWorker, wait_until
from skiplock.executor import claimed_from_row
from skiplock.worker.heartbeat import ClaimsInFlight, Heartbeat
from skiplock.worker.running import ClaimTimes, RunningJobs

QUEUE = "reconcile"
LEASE = 30.0
# Well inside the lease: a job given back by lease expiry would come later than this.
GIVEN_BACK_WITHIN = 20.0


def history(conn: psycopg.Connection[Any], job_id: int) -> tuple[int, list[Any]] | None:
    row = conn.execute(
        f"SELECT attempts, errors FROM {SCHEMA}.job_history WHERE id = %s", (job_id,)
    ).fetchone()
    return None if row is None else (int(row[0]), list(row[1]))


def stray(
    conn: psycopg.Connection[Any], task: str, worker_id: uuid.UUID, *, claimed_ahead: bool
) -> int:
    """A row as a claim whose answer never reached ``worker_id`` leaves it (or, claimed
    ahead or not, one whose completion was lost): running under that worker, attempt 1,
    claimed now, with a lease of the worker's length."""
    row = conn.execute(
        f"""
        INSERT INTO {SCHEMA}.jobs (queue, task, args, state, attempts, max_attempts, worker_id,
                                   claimed_ahead, attempted_at, started_at, worker_ids,
                                   lease_expires_at)
        VALUES (%s, %s, '{{}}', 'running', 1, 5, %s, %s, now(), now(), ARRAY[%s::uuid],
                now() + %s * interval '1 second')
        RETURNING id
        """,
        (QUEUE, task, worker_id, claimed_ahead, worker_id, LEASE),
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.timeout(60)
def test_jobs_running_under_a_live_worker_that_does_not_run_them_are_given_back(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    ran: list[tuple[int, int]] = []

    @app.task(name="reconcile.record", queue=QUEUE, max_attempts=5)
    async def record() -> None:
        job = skiplock.current_job()
        ran.append((job.id, job.attempts))

    worker = start_worker(app, queues=[QUEUE], concurrency=2, lease_seconds=LEASE).worker
    ahead = stray(autocommit, "reconcile.record", worker.id, claimed_ahead=True)
    plain = stray(autocommit, "reconcile.record", worker.id, claimed_ahead=False)

    wait_until(
        lambda: history(autocommit, ahead) and history(autocommit, plain),
        GIVEN_BACK_WITHIN,
        "both jobs to be given back by the heartbeat and run, well before their lease ends",
    )
    # Claimed ahead: it never started, so its attempt was given back, as rescue does.
    attempts, errors = history(autocommit, ahead) or (0, [])
    assert attempts == 1
    assert [(e["type"], e["attempt"], e.get("counted")) for e in errors] == [
        ("Reconciled", 1, False)
    ]
    # Not claimed ahead: it may have run (a completion lost), so the attempt counts.
    attempts, errors = history(autocommit, plain) or (0, [])
    assert attempts == 2
    assert [(e["type"], e["attempt"], e.get("counted")) for e in errors] == [
        ("Reconciled", 1, None)
    ]
    assert sorted(ran) == sorted([(ahead, 1), (plain, 2)])


@pytest.mark.timeout(60)
def test_a_claim_whose_answer_is_lost_with_its_connection_is_given_back(
    app: skiplock.App,
    start_worker: StartWorker,
    autocommit: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim commits; then its connection is terminated (pg_terminate_backend) before
    the worker reads the answer, which it never gets."""
    ran: list[int] = []

    @app.task(name="reconcile.lost", queue=QUEUE, max_attempts=5)
    async def lost() -> None:
        ran.append(skiplock.current_job().attempts)

    original = psycopg.AsyncCursor.fetchall
    cut: list[int] = []

    async def answer_lost(self: psycopg.AsyncCursor[Any]) -> list[Any]:
        columns = {c.name for c in self.description or []}
        if not cut and self.rowcount > 0 and {"args", "max_attempts"} <= columns:
            backend = self.connection.info.backend_pid
            cut.append(backend)
            with psycopg.connect(app.database_url, autocommit=True) as killer:
                killer.execute("SELECT pg_terminate_backend(%s)", (backend,))
            raise psycopg.OperationalError("the claim's answer was lost with its connection")
        return await original(self)

    monkeypatch.setattr(psycopg.AsyncCursor, "fetchall", answer_lost)
    start_worker(app, queues=[QUEUE], concurrency=2, lease_seconds=LEASE)
    job = int(lost.enqueue(autocommit))

    wait_until(lambda: cut, 10, "the claim of the job")
    wait_until(
        lambda: history(autocommit, job),
        GIVEN_BACK_WITHIN,
        "the job whose claim's answer was lost to be given back and run, before its lease ends",
    )
    attempts, errors = history(autocommit, job) or (0, [])
    # The claim was not beyond free slots: the job may have run, as far as the database
    # can tell, so the attempt counts (as when a worker dies right after a claim).
    assert [(e["type"], e["attempt"]) for e in errors] == [("Reconciled", 1)]
    assert (attempts, ran) == (2, [2])


# -- the heartbeat's decisions, against the database ------------------------------------------


def state_of(conn: psycopg.Connection[Any], job_id: int) -> tuple[Any, ...] | None:
    """(state, worker, last error type) in jobs, or ('history:' state, None, type)."""
    row = conn.execute(
        f"SELECT state, worker_id, errors -> -1 ->> 'type' FROM {SCHEMA}.jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    if row is not None:
        return tuple(row)
    row = conn.execute(
        f"SELECT 'history:' || state, NULL, errors -> -1 ->> 'type' FROM {SCHEMA}.job_history"
        " WHERE id = %s",
        (job_id,),
    ).fetchone()
    return None if row is None else tuple(row)


@pytest.mark.timeout(60)
def test_the_heartbeat_gives_back_only_what_no_claim_in_flight_or_outcome_may_deliver(
    app: skiplock.App, autocommit: psycopg.Connection[Any]
) -> None:
    """A claim in flight has committed its jobs, which are not in ``held`` until its
    answer is read; an outcome not yet flushed leaves its job running in the database.
    Neither may be given back; what is left once the claim's answer is lost may."""
    worker_id = uuid.uuid4()
    leased = RunningJobs()
    settling: set[int] = set()

    async def scenario() -> None:
        claims = ClaimsInFlight()
        heartbeat = Heartbeat(
            app.database_url,
            SCHEMA,
            worker_id,
            lease_seconds=LEASE,
            every=LEASE / 3,
            tick=1.0,
            registration=lambda: {
                "id": worker_id,
                "host": "test",
                "pid": 1,
                "queues": [QUEUE],
                "concurrency": 2,
                "holds_lock": False,
                "lease_seconds": LEASE,
                "service_restarts": Jsonb({}),
            },
            running=leased,
            request_cancel=lambda job_id: None,
            on_lost=lambda entry: None,
            claims=claims,
            settling=lambda: settling,
        )
        held = stray(autocommit, "t", worker_id, claimed_ahead=False)
        row = (held, QUEUE, "t", "{}", 0, None, 1, 3, None)
        running = leased.claimed(
            claimed_from_row(row), ClaimTimes(0.0), lambda entry: asyncio.sleep(3600)
        ).task
        try:
            outcome = stray(autocommit, "t", worker_id, claimed_ahead=False)
            settling.add(outcome)
            forgotten = stray(autocommit, "t", worker_id, claimed_ahead=True)
            cancelled = stray(autocommit, "t", worker_id, claimed_ahead=False)
            autocommit.execute(
                f"UPDATE {SCHEMA}.jobs SET cancel_requested_at = now() WHERE id = %s",
                (cancelled,),
            )
            await heartbeat.beat()
            assert state_of(autocommit, forgotten) == ("available", None, "Reconciled")
            assert state_of(autocommit, cancelled) == ("history:cancelled", None, "Cancelled")
            assert state_of(autocommit, held) == ("running", worker_id, None)
            assert state_of(autocommit, outcome) == ("running", worker_id, None)

            # A claim goes out and commits; its answer is on its way.
            answer = asyncio.Event()

            async def claim(_: None) -> None:
                await answer.wait()
                raise psycopg.OperationalError("the answer was lost with its connection")

            in_flight = asyncio.ensure_future(claims.track(claim)(None))
            await asyncio.sleep(0)
            claimed = stray(autocommit, "t", worker_id, claimed_ahead=True)
            for _ in range(2):
                await heartbeat.beat()
                assert state_of(autocommit, claimed) == ("running", worker_id, None)
            answer.set()
            with pytest.raises(psycopg.OperationalError):
                await in_flight
            await heartbeat.beat()
            assert state_of(autocommit, claimed) == ("available", None, "Reconciled")
            assert state_of(autocommit, outcome) == ("running", worker_id, None)

            # The outcome was not written after all (the flush was refused, say).
            settling.clear()
            await heartbeat.beat()
            assert state_of(autocommit, outcome) == ("available", None, "Reconciled")
            assert state_of(autocommit, held) == ("running", worker_id, None)
            assert heartbeat.given_back == 4
        finally:
            running.cancel()
            await heartbeat.close()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_busy_worker_gives_back_nothing_it_runs_or_is_claiming(
    app: skiplock.App, start_worker: StartWorker, autocommit: psycopg.Connection[Any]
) -> None:
    """Short jobs claimed ahead in batches and a beat every 0.3 s: at almost every beat a
    claim is in flight, jobs wait for a slot and outcomes wait for their flush. None of
    them may be taken for a job the worker does not run."""

    @app.task(name="reconcile.short", queue=QUEUE, max_attempts=5)
    async def short() -> None:
        await asyncio.sleep(0.002)

    with autocommit.transaction():
        ids = app.enqueue_many(autocommit, [short.job() for _ in range(3000)])
    start_worker(app, queues=[QUEUE], concurrency=4, lease_seconds=0.9)

    def done() -> bool:
        count = autocommit.execute(
            f"SELECT count(*) FROM {SCHEMA}.job_history WHERE id = ANY(%s)", (ids,)
        ).fetchone()
        return count is not None and int(count[0]) == len(ids)

    wait_until(done, 90, "the jobs to complete")
    given_back = autocommit.execute(
        f"""
        SELECT id, errors FROM {SCHEMA}.job_history
        WHERE jsonb_path_exists(errors, '$[*] ? (@.type == "Reconciled")')
        """
    ).fetchall()
    assert given_back == []
