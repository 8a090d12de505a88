"""Lease mode: jobs claimed with a lease, each run as a task of its own (the handler in
the executor), its outcome handed to the completer. Each job held is a ``RunningJob`` in
one registry (running.py), whose leases the heartbeat keeps; a job whose lease was lost is
cancelled without an outcome of ours to write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from functools import partial
from typing import Any
from uuid import UUID

from psycopg_pool import AsyncConnectionPool

from skiplock import executor
from skiplock.app import App
from skiplock.completer import Completer
from skiplock.cursor import ClaimCursor
from skiplock.durable import StepStore
from skiplock.events import EventStream
from skiplock.outcomes import Cancelled, Completed, Outcome, Suspended
from skiplock.sql import claim, render
from skiplock.types import ClaimedJob
from skiplock.worker.heartbeat import ClaimsInFlight
from skiplock.worker.limits import QueueLimits
from skiplock.worker.producer import ClaimAhead, Fetch, Reservation, Slots
from skiplock.worker.running import ClaimTimes, RunningJob, RunningJobs
from skiplock.worker.starts import StartRecorder

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
# Tries of a give-back of jobs claimed ahead (fenced: a retry of one that was written
# changes nothing), and the pause between them. Unwritten, the jobs are left to their
# lease: their tasks are gone, so nothing extends it, and rescue gives them back.
GIVE_BACK_TRIES = 3
GIVE_BACK_RETRY_SECONDS = 0.1


def _claim_statements(schema: str) -> dict[tuple[bool, bool], str]:
    """The claim statements, by (marked claimed ahead, after a cursor position). Jobs
    claimed beyond free run permits may wait for one: marked claimed ahead until their
    start is recorded, so that rescue does not charge one that never started (decision
    015), and they keep their queued-scope unique key until then."""
    return {
        (False, False): render(claim.JOB_CLAIM_BATCH, schema),
        (False, True): render(claim.JOB_CLAIM_BATCH_AFTER, schema),
        (True, False): render(claim.JOB_CLAIM_AHEAD, schema),
        (True, True): render(claim.JOB_CLAIM_AHEAD_AFTER, schema),
    }


@dataclass(eq=False)
class LeasedJobs:
    """The lease-mode jobs of one worker process, from claim to outcome."""

    app: App
    worker_id: UUID
    limits: QueueLimits
    completer: Completer
    events: EventStream
    _: KW_ONLY
    lease_seconds: float
    # With prefetch, jobs claimed beyond free capacity wait (leased and heartbeated) for
    # one of these run permits (RunningJobs.waiting). Past ahead.wait_bound() they are
    # given back.
    permits: asyncio.Semaphore | None
    rng: random.Random
    # Sizes the claims beyond free slots from how long jobs take (decision 018).
    ahead: ClaimAhead | None = None
    steps: StepStore | None = None
    _wait_timer: asyncio.TimerHandle | None = field(init=False, default=None)
    # Give-back writes in flight, and the jobs each gives back.
    _giving_back: dict[asyncio.Task[None], list[int]] = field(init=False, default_factory=dict)
    given_back: int = field(init=False, default=0)
    stopping: bool = field(init=False, default=False)
    # With prefetch, what records that jobs claimed ahead have started (decision 015).
    starts: StartRecorder | None = field(init=False, default=None)
    # This worker's claims in flight: one sent before a start's confirmation came back
    # may have claimed the same job again, unregistered yet (_still_ours).
    claims: ClaimsInFlight | None = field(init=False, default=None)
    # Every job held, from its claim to the end of its task.
    running_jobs: RunningJobs = field(init=False, default_factory=RunningJobs)
    # When the last heartbeat that confirmed every lease held took its list of them
    # (monotonic seconds): see CONFIRM_AFTER_SILENCE.
    confirmed_at: float = field(init=False, default_factory=time.monotonic)
    confirm_after: float = field(init=False, default=CONFIRM_AFTER_SILENCE)
    # A confirmation that took longer than this to come says nothing of now.
    late_answer: float = field(init=False, default=CONFIRM_AFTER_SILENCE)

    def __post_init__(self) -> None:
        if self.ahead is not None:
            self.ahead.stuck = self._stuck

    @property
    def running(self) -> int:
        """Jobs whose handler runs now (not those claimed ahead, waiting for a slot)."""
        return self.running_jobs.running

    def runs_in_thread(self, entry: RunningJob) -> bool:
        """Whether the job's handler is sync (its thread cannot be cancelled)."""
        handler = self.app.tasks.get(entry.job.task)
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
        permits = self.permits
        statements = _claim_statements(self.app.schema)
        limits = self.limits
        start = partial(self._run, threads=threads, slots=slots)

        async def fetch(reservation: Reservation) -> bool:
            limit = reservation.size
            params: dict[str, Any] = {
                "queue": queue,
                "exclude_tasks": excluded,
                "limit": limit,
                "worker_id": self.worker_id,
                "lease_seconds": self.lease_seconds,
            }
            after = cursor.start()
            if after is not None:
                params.update(after_priority=after[0], after_run_at=after[1], after_id=after[2])
            await limits.settled()
            params["governed"] = governed = queue in limits
            granted = await self._take_permits(limit)
            if permits is not None and governed:
                # A limited queue is never claimed ahead: its running jobs are what its
                # limit counts (QUEUE_RUNNING), and a job waiting here would hold back
                # every worker. Only what can start now.
                params["limit"] = limit = granted
                if limit == 0:
                    return False
            # Marked: it brings more jobs than it has run permits for (without permits,
            # every job runs at once).
            marked = permits is not None and granted < limit
            statement = statements[marked, after is not None]
            claimed = ClaimTimes(time.monotonic())  # what the answer says holds from then on
            try:
                if governed:
                    rows = await limits.claim(queue, statement, params)
                else:
                    async with pool.connection() as conn:
                        cur = await conn.execute(statement, params)
                        rows = await cur.fetchall()
            except BaseException:
                self._release_permits(granted)
                raise
            self._release_permits(granted - len(rows))
            reservation.keep(len(rows))  # each job gives its slot back when it ends
            self._register(queue, rows, cursor, claimed, start, granted=granted, marked=marked)
            return len(rows) >= limit

        return fetch

    async def _take_permits(self, limit: int) -> int:
        """Take the run permits free now, up to ``limit``, for a claim's first jobs, which
        start at once: a claim that has one for every job is not marked claimed ahead.
        Free permits mean no job waits for one, so none is overtaken."""
        permits, granted = self.permits, 0
        if permits is not None:
            while granted < limit and not permits.locked():
                await permits.acquire()  # free: returns at once, without yielding
                granted += 1
        return granted

    def _register(
        self,
        queue: str,
        rows: list[Any],
        cursor: ClaimCursor,
        claimed: ClaimTimes,
        start: Callable[..., Coroutine[Any, Any, None]],
        *,
        granted: int,
        marked: bool,
    ) -> None:
        """Register a claim's jobs, each run by a task of its own, in the claim's order."""
        # Columns 4, 5 and 0 are priority, run_at and id: the claim order. RETURNING gives
        # no order, and jobs claimed ahead start in the order they are created.
        positions = sorted((row[4], row[5], row[0], row) for row in rows)
        cursor.advance([position[:3] for position in positions])
        register = self.running_jobs.claimed
        jobs: list[ClaimedJob] = []
        for n, (_, _, _, row) in enumerate(positions):
            job = executor.claimed_from_row(row)
            run = partial(
                start,
                permitted=n < granted,
                marked=marked,
                keyed=marked and bool(row[10]),  # the marked claim says which
            )
            register(job, claimed, run)
            jobs.append(job)
        # After the jobs are registered (the heartbeat lists them from there), before their
        # tasks first run.
        claimed.registered_at = time.monotonic()
        if jobs:
            self.events.claimed(queue, len(jobs), jobs)

    def _release_permits(self, n: int) -> None:
        """Give back run permits a claim took and has no job for."""
        for _ in range(n):
            if self.permits is not None:
                self.permits.release()

    async def _run(
        self,
        entry: RunningJob,
        *,
        threads: ThreadPoolExecutor,
        slots: Slots,
        permitted: bool = False,
        marked: bool = False,
        keyed: bool = False,
    ) -> None:
        self.running_jobs.began(entry)
        job, cancel = entry.job, entry.cancel
        permits = self.permits
        holds_permit = permitted  # its run permit came with the claim
        try:
            started = time.perf_counter()
            try:
                if permits is not None and not holds_permit:
                    holds_permit = await self._wait_for_permit(entry, permits)
                    started = time.perf_counter()
                if not await self._may_start(entry, marked=marked, keyed=keyed):
                    return
                outcome = await self._execute(entry, threads, slots)
            except asyncio.CancelledError:
                if not cancel.is_set() or entry.given_back:
                    # Shutdown, the lease was lost, or given back unstarted: no outcome of
                    # ours to write.
                    raise
                outcome = Cancelled(job.id, job.attempts)
            self._ended(entry, outcome, time.perf_counter() - started)
        finally:
            self.running_jobs.finished(entry)
            if holds_permit and permits is not None:
                permits.release()
            slots.give(1)

    async def _wait_for_permit(self, entry: RunningJob, permits: asyncio.Semaphore) -> bool:
        """A job claimed ahead waits for a run permit; True once it has one. Past the wait
        bound, or when the worker is asked to stop, it is given back (give_back) and its
        task cancelled here. Nothing between the permit and leaving the waiting jobs
        yields: a job waiting has not started, and never will once given back."""
        self.running_jobs.claimed_ahead(entry, asyncio.get_running_loop().time())
        if self.stopping:
            self.give_back([entry.id])  # the worker is stopping: not started
            raise asyncio.CancelledError
        if self._wait_timer is None:
            self._watch_waiting()
        try:
            await permits.acquire()
        finally:
            self.running_jobs.permitted(entry)
        return True

    async def _may_start(self, entry: RunningJob, *, marked: bool, keyed: bool) -> bool:
        """Whether ``entry`` starts now (its claim confirmed after a wait, its queued key
        released); records its start. Raises CancelledError if cancelled while it waited."""
        job = entry.job
        if self.permits is not None and not await self._still_ours(entry):
            return False
        if entry.cancel.is_set():
            raise asyncio.CancelledError  # cancelled while it waited: never ran
        if keyed:
            if not await self._start_keyed(entry):
                return False
        elif marked and self.starts is not None:
            self.starts.note(job.id, job.attempts)
        self.running_jobs.started(entry, asyncio.get_running_loop().time())
        self.events.started(job, job.attempts)
        return True

    async def _execute(
        self, entry: RunningJob, threads: ThreadPoolExecutor, slots: Slots
    ) -> Outcome:
        """Call the handler (in its process span, when traced) and return its outcome;
        a cancellation asked for makes it cancelled, however the handler ended."""
        job, cancel = entry.job, entry.cancel
        run = executor.run_leased(
            self.app,
            job,
            threads,
            rng=self.rng,
            cancel=cancel,
            progress=entry.report_progress,
            steps=self.steps,
            completing=entry.completing,
            on_abandoned=partial(self._hold_slot, slots),
        )
        tracing = self.app.tracing
        if tracing is None:
            outcome = await run
        else:
            # The span is current while the handler runs (a sync handler's thread gets a
            # copy of this task's context): its own spans are children.
            with tracing.process(job, job.attempts) as span:
                try:
                    outcome = await run
                finally:
                    if cancel.is_set():  # asked to stop: it ends cancelled (below)
                        span.ended("cancelled", None)
                if not cancel.is_set():
                    span.ended(outcome.kind, outcome.error)
        if cancel.is_set() and not outcome.cancelled and not isinstance(outcome, Suspended):
            # Asked to stop: however the handler ended (returning early, raising), the
            # job ends cancelled, as the requester was told.
            outcome = Cancelled(job.id, job.attempts)
        return outcome

    def _ended(self, entry: RunningJob, outcome: Outcome, seconds: float) -> None:
        """Report an attempt's outcome, and hand it to the completer if the job is still
        this attempt's."""
        job = entry.job
        progress = entry.take_progress()
        if progress is not None:
            outcome = dataclasses.replace(outcome, progress_json=progress)
        if entry.completed_by_handler and isinstance(outcome, Completed):
            # Its row went with the handler's transaction: the write matching nothing
            # is expected (if that transaction rolled back, the write completes the job).
            outcome = dataclasses.replace(outcome, by_handler=True)
        if self.ahead is not None:
            self.ahead.job_ended(seconds)
        self.events.ended(job, outcome, seconds)
        if isinstance(outcome, Suspended):
            return  # the handler's own statement ended the attempt: nothing to write
        if entry.held:
            self.completer.add(outcome)
        elif self.running_jobs.get(job.id) is not None:
            # Given back while it ran and claimed again by this worker: the new claim
            # writes the attempt's outcome; this one must not (the fence could not tell
            # the two apart).
            self.events.lost(job, job.attempts)
            log.warning(
                "lost the lease of job %s attempt %s while it ran (given back and "
                "claimed again); its outcome is dropped",
                job.id,
                job.attempts,
            )

    # -- jobs claimed ahead that wait too long -------------------------------------------

    def _stuck(self, bound: float) -> int:
        """Slots whose job has run longer than ``bound`` seconds."""
        return self.running_jobs.running_longer_than(bound, asyncio.get_running_loop().time())

    def _watch_waiting(self) -> None:
        """Arm the timer that gives back jobs waiting past the bound, if it is not armed."""
        if self._wait_timer is not None or self.ahead is None:
            return
        oldest = self.running_jobs.oldest_wait()
        if oldest is None:
            return
        loop = asyncio.get_running_loop()
        self._wait_timer = loop.call_at(oldest + self.ahead.wait_bound(), self._check_waiting)

    def _check_waiting(self) -> None:
        """Give back the jobs that have waited for a permit past the bound: this worker
        cannot start them, and another worker may be able to (decision 018)."""
        self._wait_timer = None
        if self.ahead is None:
            return
        now = asyncio.get_running_loop().time()
        overdue = self.running_jobs.waited_past(self.ahead.wait_bound(), now)
        if overdue:
            self.ahead.hold_off()  # before their slots come back: nothing is claimed again
            self.give_back(overdue)
        self._watch_waiting()

    def give_back(self, job_ids: list[int] | None = None) -> asyncio.Task[None] | None:
        """Give back jobs waiting for a permit (``job_ids``, or all of them: the worker is
        stopping), unstarted: their tasks end without running them, at once, and the
        database is told in one fenced statement (attempts restored, their queued-scope
        keys never dropped), which wakes the workers of their queues. Returns the write."""
        batch: dict[int, int] = {}
        for entry in self.running_jobs.give_back(job_ids):
            batch[entry.id] = entry.attempt
            if entry.task is not asyncio.current_task():  # (else it raises, itself)
                entry.task.cancel()  # inside permits.acquire(): a permit it got passes on
        if not batch:
            return None
        self.given_back += len(batch)
        self.events.given_back(len(batch))
        write = asyncio.get_running_loop().create_task(self._write_give_back(batch))
        self._giving_back[write] = list(batch)
        write.add_done_callback(lambda done: self._giving_back.pop(done, None))
        return write

    async def _write_give_back(self, batch: dict[int, int]) -> None:
        starts = self.starts
        assert starts is not None, "only a worker that claims ahead gives back"
        for attempt in range(1, GIVE_BACK_TRIES + 1):
            try:
                moved = await starts.give_back(batch, stopping=self.stopping)
            except Exception as exc:
                if attempt == GIVE_BACK_TRIES:
                    log.warning(
                        "could not give back %d jobs claimed ahead (%s); their leases will "
                        "run out and rescue gives them back",
                        len(batch),
                        exc,
                    )
                    return
                await asyncio.sleep(GIVE_BACK_RETRY_SECONDS * attempt)
            else:
                log.debug("gave back %d of %d jobs claimed ahead", moved, len(batch))
                return

    def give_back_waiting(self) -> asyncio.Task[None] | None:
        """The worker is stopping: every job waiting for a permit, and any that comes to
        wait from now on, is given back at once instead of waiting for the running jobs."""
        self.stopping = True
        return self.give_back()

    async def given_back_written(self) -> None:
        """Wait for the give-back writes in flight."""
        while self._giving_back:
            await asyncio.gather(*list(self._giving_back), return_exceptions=True)

    def giving_back(self) -> list[int]:
        """The jobs whose give-back is being written: still this worker's in the database
        for a moment, and not for the heartbeat's reconciliation to give back again (it
        would charge, or spend the uncounted rescue of, a job that never started)."""
        return [job_id for batch in self._giving_back.values() for job_id in batch]

    def confirmed(self, asked_at: float) -> None:
        """A heartbeat confirmed every lease held when it took its list of them at
        ``asked_at`` (and stopped the lost ones)."""
        self.confirmed_at = max(self.confirmed_at, asked_at)

    def _fresh_since(self, claimed: ClaimTimes) -> float:
        """Since when the database is known to hold a job claimed at ``claimed`` for this
        worker: since its claim was asked, or since a later heartbeat asked, if that one
        asked about it (took its list after the job was registered)."""
        if self.confirmed_at > claimed.registered_at:
            return max(claimed.asked_at, self.confirmed_at)
        return claimed.asked_at

    async def _still_ours(self, entry: RunningJob) -> bool:
        """Whether a job that waited for a slot may start. After a silence (a cut link,
        a frozen process) its claim is read first: a rescuer may have given it back and
        another worker run it, and the heartbeat that would tell may not have come yet.
        Unconfirmed, it is dropped without an outcome: if it is still ours after all, its
        lease runs out and it runs again."""
        job = entry.job
        if not entry.held:
            self._superseded(entry)
            self.events.lost(job, job.attempts)
            return False
        if (
            self.starts is None
            or time.monotonic() - self._fresh_since(entry.claim) <= self.confirm_after
        ):
            return True
        answered_at = await self._confirm_claim(job)
        if answered_at is None:
            self.events.lost(job, job.attempts)
            return False
        # The row reads as ours also when this worker claimed the job again meanwhile
        # (the same attempt number): that claim, committed before the answer, may not be
        # registered yet. Once the claims sent before the answer have returned, the
        # registry says which entry holds the job.
        if self.claims is not None and not await self.claims.returned(
            answered_at, self.late_answer
        ):
            self.events.lost(job, job.attempts)
            log.warning(
                "job %s attempt %s: a claim of this worker stayed unanswered while its "
                "start was confirmed; not starting it",
                job.id,
                job.attempts,
            )
            return False
        if not entry.held:
            self._superseded(entry)
            self.events.lost(job, job.attempts)
            return False
        return True

    async def _confirm_claim(self, job: ClaimedJob) -> float | None:
        """When the database's fresh yes to "is ``job`` still claimed by this attempt?"
        was read (monotonic seconds), or None, saying why, if it said no, could not be
        asked, or every yes came as late as its question."""
        assert self.starts is not None
        for _ in range(CONFIRM_TRIES):
            asked_at = time.monotonic()
            try:
                # Claimed again by this worker meanwhile, the row reads as ours: hence the
                # caller's second look at the registry.
                ours = await self.starts.still_claimed(job.id, job.attempts)
            except Exception as exc:  # unconfirmed either way: it must not start
                log.warning(
                    "job %s: could not confirm its claim after a silence (%s); not starting it",
                    job.id,
                    exc,
                )
                return None
            if not ours:
                log.warning(
                    "job %s attempt %s: given back while it waited for a slot (this "
                    "worker was out of touch); not starting it",
                    job.id,
                    job.attempts,
                )
                return None
            answered_at = time.monotonic()
            if answered_at - asked_at <= self.late_answer:
                return answered_at
            # The yes is as old as the question: the worker stopped while it was on its
            # way, and the job may have been given back since. Ask again.
        log.warning(
            "job %s attempt %s: every confirmation of its claim came late; not starting it",
            job.id,
            job.attempts,
        )
        return None

    async def _start_keyed(self, entry: RunningJob) -> bool:
        """Release a claimed-ahead job's queued-scope key, recording its start, before it
        starts (JOB_START_KEYED). Not written, it does not start: its lease runs out,
        and rescue gives it back with its key."""
        assert self.starts is not None
        job = entry.job
        for attempt in range(1, CONFIRM_TRIES + 1):
            try:
                started = await self.starts.start_keyed(job.id, job.attempts)
            except Exception as exc:
                log.warning(
                    "job %s: could not release its queued unique key (%s); not starting it",
                    job.id,
                    exc,
                )
                break
            if started:
                # Given back and claimed again meanwhile by this worker: the new claim's
                # task runs it (the write could not tell the two apart).
                if not entry.held:
                    self._superseded(entry)
                return entry.held
            if attempt < CONFIRM_TRIES:
                await asyncio.sleep(GIVE_BACK_RETRY_SECONDS)  # locked by another transaction?
        else:
            log.warning(
                "job %s attempt %s: no longer this worker's, or its row stayed locked; "
                "not starting it",
                job.id,
                job.attempts,
            )
        self.events.lost(job, job.attempts)
        return False

    def _superseded(self, entry: RunningJob) -> None:
        """Say why ``entry``, no longer held, does not start: given back while it waited,
        and maybe claimed again by this worker, whose newer attempt is held now."""
        log.warning(
            "job %s attempt %s: given back while it waited for a slot%s; not starting it",
            entry.id,
            entry.attempt,
            ""
            if self.running_jobs.get(entry.id) is None
            else " and claimed again (the new claim runs it)",
        )

    def _hold_slot(self, slots: Slots, thread: asyncio.Future[Any]) -> None:
        """A timed-out sync handler still occupies a thread: keep a slot taken until it
        returns, so the worker does not claim jobs it has no thread for."""
        slots.take(1)
        thread.add_done_callback(lambda _: slots.give(1))

    def request_cancel(self, job_id: int) -> None:
        """Stop a running job of this worker: async handlers are cancelled, sync handlers
        see ``skiplock.cancel_requested()`` turn true. The job ends cancelled."""
        entry = self.running_jobs.cancelled(job_id)
        if entry is None:
            return
        log.info("cancelling job %s on request", job_id)
        if not self.runs_in_thread(entry):
            entry.task.cancel()

    def lost(self, entry: RunningJob) -> None:
        """The heartbeat found ``entry``'s lease lost: its task is cancelled, no outcome."""
        if not self.running_jobs.lease_lost(entry):
            return
        self.events.lost(entry.job, entry.attempt)
        log.warning("lost the lease of job %s attempt %s; cancelling it", entry.id, entry.attempt)
        entry.task.cancel()

    def cut_short(self, entry: RunningJob) -> None:
        """Shutdown: ``entry`` still runs at the timeout; it leaves the registry (the drain
        releases it) and its task is cancelled."""
        if self.running_jobs.lease_lost(entry):
            entry.task.cancel()
