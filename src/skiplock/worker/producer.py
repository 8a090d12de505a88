"""Claiming for free capacity: a producer per queue (and per execution mode).

A producer asks for at most as many jobs as there are free slots, claims again at once
when a full batch came back (more is probably waiting), and otherwise sleeps until a
notification, a slot frees up, or the poll interval passes, whichever is first.

Slots are the process's capacity, shared by every producer of every queue. A producer
reserves the slots it asks for before its claim goes out, and gets back what the claim
did not use when it returns: producers of different queues claiming at the same moment
must not all count the same free slots (decision 001; ``--concurrency`` caps the process).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

import psycopg

from skiplock.retry import RetryPolicy
from skiplock.waiting import wait_event
from skiplock.worker.wakeup import Armed, WakeupSession

log = logging.getLogger("skiplock.worker.producer")

RECONNECT = RetryPolicy(base=0.1, factor=2.0, cap=10.0, jitter=0.5)

# A producer whose claim came back short keeps claiming every LINGER_GAP for this long
# before it arms its queue's sentinel (decision 023): under a steady flow a claim a
# millisecond later finds the next jobs, and arming would make each insert until then
# notify. An insert in flight that keeps it from arming makes it claim again after
# LINGER_GAP, then at doubling gaps up to IN_FLIGHT_GAP_MAX.
LINGER_SECONDS = 0.005
LINGER_GAP = 0.001
IN_FLIGHT_GAP_MAX = 0.016


class Slots:
    """Free execution capacity shared by every producer of a worker process."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._freed = asyncio.Event()
        self._freed.set()

    def reserve(self, n: int, gate: asyncio.Semaphore | None = None) -> Reservation:
        """Take ``n`` slots now, for a claim about to go out (see Reservation)."""
        self.take(n)
        return Reservation(self, n, gate)

    def resize(self, total: int) -> None:
        """Change the capacity; jobs in flight beyond a smaller one keep their slots."""
        self.free += total - self.total
        self.total = total
        if self.free > 0:
            self._freed.set()

    def take(self, n: int) -> None:
        self.free -= n
        if self.free <= 0:
            self._freed.clear()

    def give(self, n: int = 1) -> None:
        self.free += n
        self._freed.set()

    async def wait_free(self, enough: int = 1, patience: float = 0.0) -> None:
        """Wait for a free slot, then up to ``patience`` seconds more for ``enough`` of them.

        Short jobs free slots one at a time; claiming the moment one frees would mean a
        round trip per job. A moment's patience turns that into one claim per batch.
        """
        while self.free <= 0:
            self._freed.clear()
            await self._freed.wait()
        if self.free >= enough or patience <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while self.free < enough:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._freed.clear()
            await wait_event(self._freed, remaining)

    @property
    def busy(self) -> int:
        return self.total - self.free


# Claim ahead only while the claim's round trip is at least this share of the time a slot
# takes to run a job: below it, making a job wait for a slot costs more than it saves.
AHEAD_WORTHWHILE = 0.1
# Weight of the newest sample in the running averages of job and claim durations.
AHEAD_SMOOTHING = 0.2
# How long a job claimed ahead may wait at its worker for a slot before the worker gives
# it back (or twice the claim's round trip, if that is longer): another worker may have a
# free slot for it now (decision 018). Also how long a job must have run for its slot to
# count as stuck: such slots claim nothing ahead.
GIVE_BACK_AFTER = 0.05


class ClaimAhead:
    """How many jobs a worker claims beyond its free slots (decision 018).

    Enough to keep every slot busy while the next claim is on its way: ``concurrency``
    slots finish ``concurrency / job_seconds`` jobs a second, so a claim that takes
    ``claim_seconds`` must bring that many more, twice over for the claim that finds the
    queue a moment early. Short jobs are claimed in batches; jobs long enough that the
    claim's round trip hardly shows are not claimed ahead at all. ``fixed`` pins the number
    instead (the ``prefetch`` option); ``most`` caps it.

    Never more than the slots can start within ``wait_bound()``: a job that waits longer
    is given back (worker/leased.py). Slots whose job has run past that bound (``stuck``,
    told by the worker) are not counted as turning over, and after a give-back nothing is
    claimed ahead until a job ends (``hold_off``): what was given back is for the other
    workers. Pure bookkeeping: the producer's slots are resized to ``concurrency + target``.
    """

    def __init__(
        self, slots: Slots, concurrency: int, *, most: int, fixed: int | None = None
    ) -> None:
        self.slots = slots
        self.concurrency = concurrency
        self.most = most if fixed is None else fixed
        self.fixed = fixed
        self.job_seconds: float | None = None
        self.claim_seconds: float | None = None
        self.patience = GIVE_BACK_AFTER
        # Slots whose job has run longer than wait_bound(); the worker sets it.
        self.stuck: Callable[[float], int] = lambda bound: 0
        self.held_off = False
        self.target = 0 if fixed is None else fixed
        slots.resize(concurrency + self.target)

    def wait_bound(self) -> float:
        """How long a job claimed ahead may wait for a slot at this worker."""
        return max(self.patience, 2 * (self.claim_seconds or 0.0))

    def job_ended(self, seconds: float) -> None:
        previous = self.job_seconds
        self.job_seconds = (
            seconds if previous is None else previous + AHEAD_SMOOTHING * (seconds - previous)
        )
        self.held_off = False  # a slot turned over

    def claimed(self, seconds: float) -> None:
        previous = self.claim_seconds
        self.claim_seconds = (
            seconds if previous is None else previous + AHEAD_SMOOTHING * (seconds - previous)
        )
        self.adjust()

    def hold_off(self) -> None:
        """Jobs claimed ahead were given back: claim none ahead until a job ends."""
        self.held_off = True
        self.adjust()

    def adjust(self) -> None:
        """Size the claims for what the slots are doing now (before each claim)."""
        target = 0
        if not self.held_off:
            bound = self.wait_bound()
            target = ahead_target(
                self.concurrency,
                self.most,
                self.job_seconds,
                self.claim_seconds,
                stuck=self.stuck(bound),
                bound=bound,
                fixed=self.fixed,
            )
        if target != self.target:
            self.target = target
            self.slots.resize(self.concurrency + target)


def ahead_target(
    concurrency: int,
    most: int,
    job_seconds: float | None,
    claim_seconds: float | None,
    *,
    stuck: int = 0,
    bound: float = GIVE_BACK_AFTER,
    fixed: int | None = None,
) -> int:
    """Jobs to claim beyond free slots for jobs and claims of these durations, with
    ``stuck`` of the ``concurrency`` slots running a job longer than ``bound``: a pinned
    number (``fixed``) shrinks with the slots that turn over; the sized one is 0 until a
    job and a claim have been seen. Never more than the slots that turn over start within
    ``bound``. Pure."""
    turning = concurrency - stuck
    if turning <= 0 or most <= 0:
        return 0
    if fixed is not None:
        target = min(most, math.ceil(fixed * turning / concurrency))
    elif job_seconds is None or claim_seconds is None:
        return 0
    else:
        need = 2 * turning * claim_seconds / max(job_seconds, 1e-6)
        if need < AHEAD_WORTHWHILE * turning:
            return 0
        target = min(most, math.ceil(need))
    if job_seconds is not None:
        target = min(target, math.floor(turning * bound / max(job_seconds, 1e-6)))
    return target


class Reservation:
    """Slots taken for one claim before it goes out, and what the claim kept of them.

    A fetch calls ``keep(n)`` as it hands n slots on to work it started (each of which
    gives its slot back when it ends); ``settle`` returns the rest, however the fetch
    ended. ``permit`` says a run permit of ``gate`` (the prefetch gate) is held for work
    that runs as soon as it starts (a transactional session); that work takes it on.
    """

    __slots__ = ("gate", "jobs", "kept", "permit", "size", "slots")

    def __init__(self, slots: Slots, size: int, gate: asyncio.Semaphore | None = None) -> None:
        self.slots = slots
        self.size = size
        self.kept = 0
        self.gate = gate
        self.permit = False
        # How many jobs the claim brought, when that is not the slots it kept (a
        # transactional session keeps one slot for its whole batch).
        self.jobs: int | None = None

    def keep(self, n: int) -> None:
        if self.kept + n > self.size:
            raise ValueError(f"kept {self.kept + n} of {self.size} reserved slots")
        self.kept += n

    def take_permit(self) -> bool:
        """Hand the run permit on to the work just started; True if there was one."""
        held, self.permit = self.permit, False
        return held

    def settle(self, _: object = None) -> None:
        """Give back what was not kept (a done-callback of the fetch, hence the argument)."""
        if self.size > self.kept:
            self.slots.give(self.size - self.kept)
            self.size = self.kept
        if self.permit and self.gate is not None:
            self.gate.release()
        self.permit = False


# A fetch claims at most `reservation.size` units of work and starts them, keeping a slot
# for each; it says whether the claim came back full (more is probably waiting).
Fetch = Callable[[Reservation], Awaitable[bool]]


@dataclass(eq=False)
class Producer:
    name: str
    fetch: Fetch
    slots: Slots
    wake: asyncio.Event
    _: KW_ONLY
    batch_max: int
    poll_interval: float
    fetch_patience: float = 0.002
    backpressure: Callable[[], Awaitable[None]] | None = None
    # Work that runs as soon as it starts (transactional sessions) also needs one of the
    # prefetch gate's run permits, which jobs claimed ahead wait for.
    gate: asyncio.Semaphore | None = None
    # Lease-mode claims only: told how long each claim took, and sized again before each
    # claim.
    ahead: ClaimAhead | None = None
    # Inserts wake this producer only through a sentinel it arms (decision 023), and only
    # with a queue.
    queue: str | None = None
    waiting: WakeupSession | None = None
    claims: int = field(init=False, default=0)
    pending: asyncio.Future[bool] | None = field(init=False, default=None)
    _rng: random.Random = field(init=False, default_factory=random.Random)
    _failures: int = field(init=False, default=0)  # claims failed in a row, for the back-off
    # When a claim last brought jobs, and the wait while an insert blocks arming.
    _last_jobs: float = field(init=False, default=-math.inf)
    _gap: float = field(init=False, default=LINGER_GAP)

    def __post_init__(self) -> None:
        if self.queue is None:
            self.waiting = None

    async def run(self) -> None:
        """Claim for free slots, again and again; between claims, wait as the last one
        says: at once after a full batch, briefly while jobs keep coming (the linger),
        else on the queue's sentinel (decision 023) or the poll interval."""
        while True:
            reservation = await self._reserve()
            if reservation is None:
                continue
            full = await self._claim(reservation)
            if full is None:
                continue
            self.claims += 1
            await self._rest(reservation, full)

    async def _reserve(self) -> Reservation | None:
        """Wait for free slots (and a run permit when jobs are claimed ahead) and reserve
        them; None when another claim took them first."""
        await self.slots.wait_free(
            min(self.batch_max, max(1, self.slots.total // 2)), self.fetch_patience
        )
        if self.backpressure is not None:
            await self.backpressure()
        if self.ahead is not None:
            # Sized for the slots as they are now: one stuck on a long job since the last
            # claim must not take jobs ahead that would wait behind it.
            self.ahead.adjust()
        want = min(self.slots.free, self.batch_max)
        if want <= 0:
            return None
        reservation = self.slots.reserve(want, self.gate)
        if self.gate is not None:
            try:
                # Holding the slot, never the other way round: jobs claimed ahead hold
                # slots while they wait for a permit.
                await self.gate.acquire()
            except BaseException:
                reservation.settle()
                raise
            reservation.permit = True
        return reservation

    async def _claim(self, reservation: Reservation) -> bool | None:
        """One claim: whether it came back full, or None when it failed (retried after a
        back-off: nothing may end claiming on this queue for good)."""
        # Clear before claiming: a notification that lands during the claim re-arms it.
        self.wake.clear()
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            # Shielded: a claim commits in the database before its rows reach us, so
            # cancelling it half-way (at shutdown) would strand the claimed jobs. The
            # worker awaits `pending` before it drains.
            self.pending = pending = asyncio.ensure_future(self.fetch(reservation))
            pending.add_done_callback(reservation.settle)
            full = await asyncio.shield(pending)
        except Exception as exc:
            self._failures += 1
            delay = RECONNECT.delay(self._failures, self._rng)
            if isinstance(exc, psycopg.OperationalError):
                log.warning("%s: claim failed (%s); retrying in %.2fs", self.name, exc, delay)
            else:
                log.exception("%s: claim failed; retrying in %.2fs", self.name, delay)
            await asyncio.sleep(delay)
            return None
        self._failures = 0
        if self.ahead is not None:
            self.ahead.claimed(loop.time() - began)
        return full

    async def _rest(self, reservation: Reservation, full: bool) -> None:
        """Wait until the next claim is worth making."""
        if self.waiting is None or self.queue is None:
            if not full:
                await wait_event(self.wake, self.poll_interval)
            return
        now = asyncio.get_running_loop().time()
        if reservation.kept if reservation.jobs is None else reservation.jobs:
            self.waiting.busy(self.queue, self)
            self._last_jobs, self._gap = now, LINGER_GAP
        if full:
            return  # a full batch: more is probably waiting
        if now - self._last_jobs < LINGER_SECONDS:
            await wait_event(self.wake, LINGER_GAP)
            return
        armed = await self.waiting.arm(self.queue, self)
        if armed is not Armed.IN_FLIGHT:
            self._gap = LINGER_GAP
        if armed is Armed.NOW:
            return  # what committed before the keys were taken notified nobody
        if armed is Armed.IN_FLIGHT:
            await wait_event(self.wake, min(self._gap, IN_FLIGHT_GAP_MAX, self.poll_interval))
            self._gap = min(self._gap * 2, IN_FLIGHT_GAP_MAX)
            return
        await wait_event(self.wake, self.poll_interval)
