"""Lease mode: jobs claimed with a lease, each run as a task of its own (the handler in
the executor), its outcome handed to the completer. The heartbeat keeps the leases of
``held``; a job whose lease was lost is cancelled without an outcome of ours to write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any
from uuid import UUID

from psycopg_pool import AsyncConnectionPool

from skiplock import executor
from skiplock.app import App
from skiplock.completer import Completer, Outcome
from skiplock.context import CancelFlag
from skiplock.cursor import ClaimCursor
from skiplock.metrics import NullMetrics
from skiplock.sql import claim, render
from skiplock.types import ClaimedJob
from skiplock.worker import job_log
from skiplock.worker.heartbeat import Leased
from skiplock.worker.limits import QueueLimits
from skiplock.worker.producer import ClaimAhead, Fetch, Reservation, Slots
from skiplock.worker.starts import StartRecorder
from skiplock.worker.stats import WorkerStats

log = logging.getLogger("skiplock.worker")

# A job claimed ahead starts without a word to the database when its claim, or the last
# heartbeat (which confirms every lease the worker holds, and stops the lost ones), is at
# most this many seconds old. Past that, the worker may have been cut off or stopped,
# found dead and its jobs run elsewhere: the job's claim is read first. Flushes and other
# claims say nothing about it: they succeed as well for a worker just resumed. An answer
# is as old as its question: a process stopped after the server answered reads the answer
# only when it resumes, so each is timed from when it was asked, and a heartbeat speaks
# only for the jobs it asked about.
CONFIRM_AFTER_SILENCE = 1.0
# Confirmations asked in a row before a job is left unstarted: an answer that took longer
# than CONFIRM_AFTER_SILENCE to arrive says nothing of now.
CONFIRM_TRIES = 3


@dataclasses.dataclass
class ClaimTimes:
    """When a claim was asked, and when its jobs were in ``held`` (its answer read)."""

    asked_at: float
    held_at: float = math.inf


class LeasedJobs:
    """The lease-mode jobs of one worker process, from claim to outcome."""

    def __init__(
        self,
        app: App,
        worker_id: UUID,
        limits: QueueLimits,
        completer: Completer,
        stats: WorkerStats,
        metrics: NullMetrics,
        *,
        lease_seconds: float,
        gate: asyncio.Semaphore | None,
        rng: random.Random,
        ahead: ClaimAhead | None = None,
    ) -> None:
        self._app = app
        self._worker_id = worker_id
        self._limits = limits
        self.completer = completer
        self._stats = stats
        self._metrics = metrics
        self._lease_seconds = lease_seconds
        # With prefetch, jobs claimed beyond free capacity wait (leased and heartbeated)
        # at this gate for a slot; ``at_gate`` are those waiting.
        self._gate = gate
        self.at_gate: set[int] = set()
        # Sizes the claims beyond free slots from how long jobs take (decision 018).
        self.ahead = ahead
        # With prefetch, what records that jobs claimed ahead have started (decision 015).
        self.starts: StartRecorder | None = None
        self._rng = rng
        # In flight: id -> (attempt, the task running it).
        self.held: Leased = {}
        self._cancel_flags: dict[int, CancelFlag] = {}
        self._job_tasks: dict[int, str] = {}
        self._progress: dict[int, tuple[int, str]] = {}
        # When the last heartbeat that confirmed every lease held took its list of them
        # (monotonic seconds): see CONFIRM_AFTER_SILENCE.
        self.confirmed_at = time.monotonic()
        self.confirm_after = CONFIRM_AFTER_SILENCE
        # A confirmation that took longer than this to come says nothing of now.
        self.late_answer = CONFIRM_AFTER_SILENCE

    @property
    def running(self) -> int:
        """Jobs whose handler runs now (not those claimed ahead, waiting for a slot)."""
        return len(self.held) - len(self.at_gate)

    def runs_in_thread(self, job_id: int) -> bool:
        """Whether the job's handler is sync (its thread cannot be cancelled)."""
        handler = self._app.tasks.get(self._job_tasks.get(job_id, ""))
        return handler is None or not handler.is_async

    def fetch(
        self,
        pool: AsyncConnectionPool[Any],
        queue: str,
        cursor: ClaimCursor,
        excluded: list[str],
        threads: ThreadPoolExecutor,
        slots: Slots,
    ) -> Fetch:
        schema = self._app.schema
        # Jobs claimed beyond free slots may wait for one: marked claimed ahead until they
        # start, so that rescue does not charge one that never did (decision 015).
        statements = {
            (False, False): render(claim.JOB_CLAIM_BATCH, schema),
            (False, True): render(claim.JOB_CLAIM_BATCH_AFTER, schema),
            (True, False): render(claim.JOB_CLAIM_AHEAD, schema),
            (True, True): render(claim.JOB_CLAIM_AHEAD_AFTER, schema),
        }
        limits = self._limits

        async def fetch(reservation: Reservation) -> bool:
            limit = reservation.size
            params: dict[str, Any] = {
                "queue": queue,
                "exclude_tasks": excluded,
                "limit": limit,
                "worker_id": self._worker_id,
                "lease_seconds": self._lease_seconds,
            }
            after = cursor.start()
            if after is not None:
                params.update(after_priority=after[0], after_run_at=after[1], after_id=after[2])
            statement = statements[reservation.ahead, after is not None]
            await limits.settled()
            asked_at = time.monotonic()  # what the answer says holds from then on, at best
            if queue in limits:
                rows = await limits.claim(queue, statement, params)
            else:
                async with pool.connection() as conn:
                    cur = await conn.execute(statement, params)
                    rows = await cur.fetchall()
            reservation.keep(len(rows))  # each job gives its slot back when it ends
            claimed = ClaimTimes(asked_at)
            self._stats.claimed += len(rows)
            if rows:
                self._stats.claims += 1
                self._stats.largest_claim = max(self._stats.largest_claim, len(rows))
                self._metrics.claimed(queue, len(rows))
            # Columns 4, 5 and 0 are priority, run_at and id: the claim order. RETURNING
            # gives no order, and jobs claimed ahead start in the order they are created.
            positions = sorted((row[4], row[5], row[0], row) for row in rows)
            rows = [position[3] for position in positions]
            cursor.advance([position[:3] for position in positions])
            told = job_log.told()
            for row in rows:
                job = executor.claimed_from_row(row)
                task = asyncio.create_task(self._run(job, threads, slots, claimed))
                self.held[job.id] = (job.attempts, task)
                self._job_tasks[job.id] = job.task
                if told:
                    job_log.claimed(job)
            # After the jobs are in ``held`` (the heartbeat, on its own thread, lists them
            # from there), before their tasks first run.
            claimed.held_at = time.monotonic()
            return len(rows) >= limit

        return fetch

    async def _run(
        self,
        job: ClaimedJob,
        threads: ThreadPoolExecutor,
        slots: Slots,
        claimed: ClaimTimes,
    ) -> None:
        cancel = self._cancel_flags[job.id] = CancelFlag()
        gate = self._gate
        gated = False
        try:
            started = time.perf_counter()
            try:
                if gate is not None:
                    # A prefetched job waits for a free slot; at shutdown _drain gives it
                    # back, and a cancel request ends it here without running it.
                    self.at_gate.add(job.id)
                    try:
                        await gate.acquire()
                        gated = True
                    finally:
                        self.at_gate.discard(job.id)
                    started = time.perf_counter()
                    if not await self._still_ours(job, claimed):
                        return
                if cancel.is_set():
                    raise asyncio.CancelledError  # cancelled while it waited: never ran
                if self.starts is not None:
                    self.starts.note(job.id, job.attempts)
                self._metrics.job_started(job, job.attempts)
                run = executor.run_leased(
                    self._app,
                    job,
                    threads,
                    rng=self._rng,
                    cancel=cancel,
                    progress=partial(self._record_progress, job.id, job.attempts),
                    on_abandoned=partial(self._hold_slot, slots),
                )
                tracing = self._app.tracing
                if tracing is None:
                    outcome = await run
                else:
                    # The span is current while the handler runs (a sync handler's thread
                    # gets a copy of this task's context): its own spans are children.
                    with tracing.process(job, job.attempts) as span:
                        try:
                            outcome = await run
                        finally:
                            if cancel.is_set():  # asked to stop: it ends cancelled (below)
                                span.ended("cancelled", None)
                        if not cancel.is_set():
                            span.ended(outcome.kind, outcome.error)
            except asyncio.CancelledError:
                if not cancel.is_set():
                    raise  # shutdown, or the lease was lost: no outcome of ours to write
                outcome = Outcome(job.id, job.attempts, cancelled=True)
            if cancel.is_set() and not outcome.cancelled:
                # Asked to stop: however the handler ended (returning early, raising), the
                # job ends cancelled, as the requester was told.
                outcome = Outcome(job.id, job.attempts, cancelled=True)
            pending = self._progress.pop(job.id, None)
            if pending is not None and pending[0] == job.attempts:
                outcome = dataclasses.replace(outcome, progress_json=pending[1])
            seconds = time.perf_counter() - started
            if self.ahead is not None:
                self.ahead.job_ended(seconds)
            self._metrics.job_finished(job.queue, job.task, outcome.kind, seconds)
            if outcome.error is not None:
                self._metrics.job_failed(job.queue, job.task, outcome.error)
            job_log.finished(job, outcome, seconds)
            holder = self.held.get(job.id, (None, None))[1]
            if holder is asyncio.current_task():
                self.completer.add(outcome)
            elif holder is not None:
                # Given back while it ran and claimed again by this worker: the new claim
                # writes the attempt's outcome; this one must not (the fence could not
                # tell the two apart).
                self._stats.lost_leases += 1
                log.warning(
                    "lost the lease of job %s attempt %s while it ran (given back and "
                    "claimed again); its outcome is dropped",
                    job.id,
                    job.attempts,
                )
        finally:
            # Another task may hold the job now (given back and claimed again by this
            # worker): its entries are left alone.
            entry = self.held.get(job.id)
            mine = entry is not None and entry[1] is asyncio.current_task()
            if mine:
                del self.held[job.id]
            if entry is None or mine:
                self._cancel_flags.pop(job.id, None)
                self._job_tasks.pop(job.id, None)
            if gated and gate is not None:
                gate.release()
            slots.give(1)

    def confirmed(self, asked_at: float) -> None:
        """A heartbeat confirmed every lease held when it took its list of them at
        ``asked_at`` (and stopped the lost ones)."""
        self.confirmed_at = max(self.confirmed_at, asked_at)

    def _fresh_since(self, claimed: ClaimTimes) -> float:
        """Since when the database is known to hold a job claimed at ``claimed`` for this
        worker: since its claim was asked, or since a later heartbeat asked, if that one
        asked about it (took its list after the job was in it)."""
        if self.confirmed_at > claimed.held_at:
            return max(claimed.asked_at, self.confirmed_at)
        return claimed.asked_at

    async def _still_ours(self, job: ClaimedJob, claimed: ClaimTimes) -> bool:
        """Whether a job that waited for a slot may start. After a silence (a cut link,
        a frozen process) its claim is read first: a rescuer may have given it back and
        another worker run it, and the heartbeat that would tell may not have come yet
        (tests/cluster showed such jobs run twice). Unconfirmed, it is dropped without an
        outcome: if it is still ours after all, its lease runs out and it runs again."""
        if self._superseded(job):
            self._stats.lost_leases += 1
            return False
        if (
            self.starts is None
            or time.monotonic() - self._fresh_since(claimed) <= self.confirm_after
        ):
            return True
        for _ in range(CONFIRM_TRIES):
            asked_at = time.monotonic()
            try:
                # Claimed again by this worker meanwhile, the row reads as ours: hence the
                # second look at ``held`` below.
                ours = await self.starts.still_claimed(job.id, job.attempts)
            except Exception as exc:  # unconfirmed either way: it must not start
                log.warning(
                    "job %s: could not confirm its claim after a silence (%s); not starting it",
                    job.id,
                    exc,
                )
                self._stats.lost_leases += 1
                return False
            if not ours:
                self._stats.lost_leases += 1
                log.warning(
                    "job %s attempt %s: given back while it waited for a slot (this "
                    "worker was out of touch); not starting it",
                    job.id,
                    job.attempts,
                )
                return False
            if time.monotonic() - asked_at <= self.late_answer:
                break
            # The yes is as old as the question: the worker stopped while it was on its
            # way, and the job may have been given back since. Ask again.
        else:
            self._stats.lost_leases += 1
            log.warning(
                "job %s attempt %s: every confirmation of its claim came late; not starting it",
                job.id,
                job.attempts,
            )
            return False
        if self._superseded(job):
            self._stats.lost_leases += 1
            return False
        return True

    def _superseded(self, job: ClaimedJob) -> bool:
        """Whether this task no longer holds the job: given back while it waited, and
        claimed again by this worker, whose newer task holds it now."""
        entry = self.held.get(job.id)
        if entry is not None and entry[1] is asyncio.current_task():
            return False
        log.warning(
            "job %s attempt %s: given back while it waited for a slot%s; not starting it",
            job.id,
            job.attempts,
            "" if entry is None else " and claimed again (the new claim runs it)",
        )
        return True

    def _hold_slot(self, slots: Slots, thread: asyncio.Future[Any]) -> None:
        """A timed-out sync handler still occupies a thread: keep a slot taken until it
        returns, so the worker does not claim jobs it has no thread for."""
        slots.take(1)
        thread.add_done_callback(lambda _: slots.give(1))

    def _record_progress(self, job_id: int, attempt: int, encoded: str) -> None:
        # Called from handler threads too: a dict assignment is atomic under the GIL.
        self._progress[job_id] = (attempt, encoded)

    def take_progress(self) -> dict[int, tuple[int, str]]:
        pending, self._progress = self._progress, {}
        return pending

    def request_cancel(self, job_id: int) -> None:
        """Stop a running job of this worker: async handlers are cancelled, sync handlers
        see ``skiplock.cancel_requested()`` turn true. The job ends cancelled."""
        flag = self._cancel_flags.get(job_id)
        entry = self.held.get(job_id)
        if flag is None or entry is None or flag.is_set():
            return
        flag.set()
        log.info("cancelling job %s on request", job_id)
        task = self._app.tasks.get(self._job_tasks.get(job_id, ""))
        if task is not None and task.is_async:
            entry[1].cancel()

    def lost(self, job_id: int, attempt: int, task: asyncio.Task[None]) -> None:
        self._stats.lost_leases += 1
        log.warning("lost the lease of job %s attempt %s; cancelling it", job_id, attempt)
        del self.held[job_id]
        task.cancel()
