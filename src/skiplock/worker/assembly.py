"""What one run of a worker is made of, and how the parts are wired to each other.

``Parts`` builds every service of a run from the worker's options and its pools, in the
order they depend on one another: claiming (slots, claim-ahead, limits, cursors, the
wake-up session), running and completing (the completer, lease-mode jobs, transactional
sessions, admission), hearing (the listener, cancels), then producers and the services
that keep the worker alive and the cluster healthy (heartbeat, election, rescue, cron,
history). ``start`` starts them in the order that keeps a half-started worker safe.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skiplock import executor
from skiplock.app import App
from skiplock.completer import Completer
from skiplock.config import control_channel, notify_channel
from skiplock.control import Wakeup
from skiplock.cursor import ClaimCursor
from skiplock.durable import LeasedStore
from skiplock.events import EventStream
from skiplock.metrics import MetricsEvents, NullMetrics
from skiplock.outcomes import Outcome
from skiplock.sql import wakeup
from skiplock.types import ClaimedJob
from skiplock.worker.cancels import CancelRequests
from skiplock.worker.cursors import CursorProbe
from skiplock.worker.heartbeat import Heartbeat
from skiplock.worker.job_log import JobLog
from skiplock.worker.leader import (
    Election,
    History,
    KeyAdmission,
    PeriodicTicks,
    Promotion,
    Rescue,
)
from skiplock.worker.leased import LeasedJobs
from skiplock.worker.limits import REFRESH_SECONDS as LIMITS_REFRESH_SECONDS
from skiplock.worker.limits import QueueLimits
from skiplock.worker.listener import Listener
from skiplock.worker.liveness import LivenessLock, session_kwargs
from skiplock.worker.pools import WorkerPools
from skiplock.worker.producer import ClaimAhead, Producer, Slots
from skiplock.worker.sessions import TransactionalSessions
from skiplock.worker.starts import StartRecorder
from skiplock.worker.stats import StatsEvents
from skiplock.worker.supervisor import Every, Loop, Service, Supervisor
from skiplock.worker.timeouts import MAINTENANCE, WAKEUP, heartbeat_bounds
from skiplock.worker.wakeup import LateCommits, WakeupSession

if TYPE_CHECKING:
    from skiplock.worker.worker import Worker

log = logging.getLogger("skiplock.worker")

# How often a busy worker looks for jobs that committed behind its claim cursor (decision
# 023): such a job waits at most about this long plus a claim.
LATE_COMMITS_SECONDS = 0.02


@dataclass(frozen=True)
class TaskSplit:
    """Per queue, the transactional tasks (async and sync), and every transactional task
    name, which lease-mode claims must leave alone."""

    tx_async: dict[str, list[str]]
    tx_sync: dict[str, list[str]]
    transactional: list[str]

    @classmethod
    def of(cls, app: App, queues: tuple[str, ...]) -> TaskSplit:
        tx_async: dict[str, list[str]] = {q: [] for q in queues}
        tx_sync: dict[str, list[str]] = {q: [] for q in queues}
        transactional: list[str] = []
        for task in app.tasks.values():
            if not task.options.transactional:
                continue
            transactional.append(task.name)
            if task.options.queue in tx_async:
                (tx_async if task.is_async else tx_sync)[task.options.queue].append(task.name)
        return cls(tx_async, tx_sync, transactional)

    @property
    def async_sessions(self) -> bool:
        return any(self.tx_async.values())

    @property
    def sync_sessions(self) -> bool:
        return any(self.tx_sync.values())


class Parts:
    """The services of one run, wired; ``worker`` supplies options, identity, the stats
    and metrics, and the callbacks through which the parts report to it."""

    def __init__(self, worker: Worker, pools: WorkerPools, split: TaskSplit) -> None:
        self.worker, self.pools, self.split = worker, pools, split
        self.options = options = worker.options
        self.schema = worker.app.schema
        # Every session of this worker holds its liveness lock: it lives while any does.
        self.liveness = LivenessLock(self.schema, worker.id, enabled=worker.liveness_lock)
        self.supervisor = Supervisor(on_restart=worker.metrics.service_restarted)
        self.wake = {queue: asyncio.Event() for queue in options.queues}
        self.cursors = {queue: ClaimCursor() for queue in options.queues}
        # Every job event of this run, told once, to the stats, the metrics and the log.
        self.events = EventStream(StatsEvents(worker.stats), JobLog())
        if type(worker.metrics) is not NullMetrics:  # nothing to tell one that exports none
            self.events.subscribe(MetricsEvents(worker.metrics))
        self._claiming()
        self._completing()
        self._hearing()
        self.producers = self._producers()
        self._keeping()

    # -- building -----------------------------------------------------------------------

    def _claiming(self) -> None:
        worker, options = self.worker, self.options
        self.slots = Slots(options.concurrency)
        self.ahead = (
            None
            if options.prefetch == 0
            else ClaimAhead(
                self.slots, options.concurrency, most=options.batch_max, fixed=options.prefetch
            )
        )
        # When claiming ahead, run permits: jobs claimed ahead wait here for one, and a
        # transactional session takes one before it starts.
        self.gate = asyncio.Semaphore(options.concurrency) if self.ahead is not None else None
        self.limits = QueueLimits(self.pools.claims, self.schema, list(options.queues), self.wake)
        self.sessions = TransactionalSessions(
            worker.app,
            self.limits,
            batch=options.transactional_batch,
            poll_interval=worker.poll_interval,
            rng=worker.rng,
            on_claimed=self.events.claimed,
            on_completed=worker.transactional_completed,
            on_finished=self.transactional_finished,
            gate=self.gate,
        )
        # Inserts notify only while a worker waits on their queue (decision 023): through
        # its sentinel keys, held by this session, which also finds late commits.
        connections = worker.connections
        self.wakeups = (
            WakeupSession(
                connections.dedicated_url,
                self.schema,
                connect_kwargs={
                    **connections.dedicated(WAKEUP.options(wakeup.WAKEUP_SESSION_OPTIONS)),
                    **session_kwargs("wakeup", worker.id),
                },
                on_lost=lambda queue: self.wake[queue].set(),
            )
            if worker.listen
            else None
        )

    def _completing(self) -> None:
        worker, options, maintenance = self.worker, self.options, self.pools.maintenance
        # Without a listener nothing announces a job scheduled for later: promotion polls,
        # but at most every second (its statements are not free on an idle queue).
        poll = worker.poll_interval
        self.promotion = Promotion(
            maintenance, self.schema, poll_interval=poll if worker.listen else max(poll, 1.0)
        )
        self.completer = Completer(
            self.pools.claims,
            self.schema,
            worker.id,
            interval=options.completer_interval,
            max_batch=max(2 * options.concurrency, 100),
            on_retry_written=self.promotion.wake.set,
            on_flush=worker.flushed,
        )
        # Durable steps of lease-mode jobs, read and recorded in batches (durable.py).
        self.steps = LeasedStore(self.pools.claims, self.schema, worker.id)
        self.jobs = LeasedJobs(
            worker.app,
            worker.id,
            self.limits,
            self.completer,
            self.events,
            lease_seconds=options.lease_seconds,
            permits=self.gate,
            rng=worker.rng,
            ahead=self.ahead,
            steps=self.steps,
        )
        self.admission = KeyAdmission(
            maintenance,
            self.schema,
            worker.leadership,
            every=options.admit_interval,
            retry_after=min(options.rescue_interval, 1.0),
            on_admitted=worker.admitted,
        )

    def _hearing(self) -> None:
        worker, connections = self.worker, self.worker.connections
        self.cancels = CancelRequests(
            self.pools.claims,
            self.schema,
            worker.id,
            attempt_of=self.jobs.running_jobs.attempt_of,
            cancel=self.cancel,
        )
        self.listener = Listener(
            connections.dedicated_url,
            notify_channel(self.schema),
            self.on_wakeup,
            self.on_connect,
            setup=(self.liveness.statement, self.liveness.params) if worker.liveness_lock else None,
            control=(control_channel(self.schema), worker.on_control),
            connect_kwargs={
                **connections.dedicated(""),
                **session_kwargs("listener", worker.id),
            },
        )

    def _producers(self) -> list[Producer]:
        """Per queue, a producer of lease-mode claims, and one per kind of transactional
        session (async, sync) when the queue has such tasks."""
        worker, pools, split, sessions = self.worker, self.pools, self.split, self.sessions
        producers: list[Producer] = []
        for queue in self.options.queues:
            wake, slots = self.wake[queue], self.slots
            fetch = self.jobs.fetch(
                pools.claims, queue, self.cursors[queue], split.transactional, pools.threads, slots
            )
            producers.append(
                Producer(
                    f"{queue}/lease",
                    worker.claims.track(fetch),
                    slots,
                    wake,
                    batch_max=self.options.batch_max,
                    poll_interval=worker.poll_interval,
                    backpressure=self.backpressure,
                    ahead=self.jobs.ahead,
                    queue=queue,
                    waiting=self.wakeups,
                )
            )
            if split.tx_async[queue]:
                session = sessions.async_session(pools.claims, queue, split.tx_async[queue], slots)
                producers.append(
                    sessions.producer(
                        queue, slots, wake, session, in_thread=False, waiting=self.wakeups
                    )
                )
            if split.tx_sync[queue] and pools.sync is not None:
                session = sessions.sync_session(
                    pools.sync, queue, split.tx_sync[queue], slots, pools.threads
                )
                producers.append(
                    sessions.producer(
                        queue, slots, wake, session, in_thread=True, waiting=self.wakeups
                    )
                )
        return producers

    def _keeping(self) -> None:
        """The heartbeat, and the services each worker runs for the cluster: election,
        rescue, cron, history, admission and the limits' refresh."""
        worker, options, maintenance = self.worker, self.options, self.pools.maintenance
        heartbeat_every = max(options.lease_seconds / 3, 0.05)
        tick = min(options.rescue_interval, heartbeat_every)
        self.heartbeat = self._heartbeat(heartbeat_every, tick)
        if self.ahead is not None:
            self.jobs.starts = StartRecorder(
                self.pools.claims, self.schema, worker.id, self.jobs.running_jobs.attempt_of
            )
            self.jobs.claims = worker.claims
        # Started once the liveness lock is held: until then a rescuer would take this
        # worker for dead, drop its registration and hand its jobs on, and an elected
        # leader without its lock could be replaced at any moment.
        self.rescue = Rescue(
            maintenance,
            self.schema,
            worker.id,
            worker.leadership,
            tick=tick,
            expired_every=max(options.lease_seconds / 2, options.rescue_interval),
            on_rescued=worker.rescued,
        )
        connections = worker.connections
        self.services: list[Service] = [
            self.heartbeat,
            Election(
                maintenance,
                self.schema,
                worker.id,
                worker.leadership,
                follower_every=options.rescue_interval,
                on_elected=self.elected,
            ),
            self.rescue,
            PeriodicTicks(maintenance, worker.app, tick=tick),
            History(
                connections.dedicated_url,
                self.schema,
                worker.leadership,
                tick=tick,
                every=options.history_interval,
                retention=options.history_retention,
                connect_kwargs=connections.dedicated(MAINTENANCE.options("")),
            ),
            self.admission,
            Every("limits", LIMITS_REFRESH_SECONDS, self.limits.read),
        ]
        if self.jobs.starts is not None:
            self.services.append(self.jobs.starts)

    def _heartbeat(self, every: float, tick: float) -> Heartbeat:
        worker, jobs, completer = self.worker, self.jobs, self.completer
        return Heartbeat(
            worker.connections.dedicated_url,
            self.schema,
            worker.id,
            lease_seconds=self.options.lease_seconds,
            every=every,
            tick=tick,
            registration=worker.registration,
            running=jobs.running_jobs,
            request_cancel=jobs.request_cancel,
            on_lost=jobs.lost,
            on_connect=self.liveness,
            on_beat=jobs.confirmed,
            connect_kwargs=worker.connections.dedicated(heartbeat_bounds(every).options()),
            claims=worker.claims,
            # Stopping, nothing is given back but by the drain.
            settling=lambda: (
                None if worker.stopping else [*completer.pending_ids(), *jobs.giving_back()]
            ),
        )

    # -- starting -----------------------------------------------------------------------

    def start_hearing(self) -> None:
        """The services that run before the worker registers: what hears of jobs and
        cancels, writes outcomes, promotes and finds jobs behind the cursors."""
        supervisor, found = self.supervisor, self.found
        supervisor.start(self.cancels)
        if self.worker.listen:
            supervisor.start(self.listener)
        supervisor.start(Loop("completer", self.completer.run))
        supervisor.start(Loop("steps", self.steps.run))
        supervisor.start(self.promotion)
        if self.wakeups is not None:
            supervisor.start(
                LateCommits(
                    self.wakeups,
                    self.schema,
                    self.cursors,
                    self.split.transactional,
                    every=LATE_COMMITS_SECONDS,
                    on_found=found,
                )
            )
        supervisor.start(
            CursorProbe(
                self.pools.maintenance,
                self.schema,
                self.cursors,
                self.split.transactional,
                every=self.options.sweep_interval,
                on_found=found,
            )
        )

    def start_working(self) -> None:
        """The rest, once the liveness lock is held and the worker registered."""
        for service in self.services:
            self.supervisor.start(service)
        for producer in self.producers:
            self.supervisor.start(producer)

    # -- how the parts call each other ---------------------------------------------------

    def found(self, queue: str) -> None:
        self.wake[queue].set()

    def on_wakeup(self, message: Wakeup) -> None:
        later = message.run_at is not None and message.run_at > executor.utcnow()
        if message.queue in self.cursors:
            self.cursors[message.queue].rewind(message)
            self.wake[message.queue].set()
            if self.wakeups is not None and not later:
                self.wakeups.woken(message.queue)  # its producers claim now
        if later:
            self.promotion.wake.set()  # scheduled for later: recompute the next due time

    def on_connect(self) -> None:
        if self.wakeups is not None:
            self.wakeups.reset()  # its keys may have gone with the listener's server
        # Whatever was announced while the listener was away is unknown: sweep.
        for queue, cursor in self.cursors.items():
            cursor.force_sweep()
            self.wake[queue].set()
        self.promotion.wake.set()
        self.admission.ask_all()

    def elected(self) -> None:
        self.admission.ask_all()  # a new leader admits every waiting key
        self.rescue.wake.set()  # and rescues at once: the old leader may be the dead one

    def transactional_finished(self, job: ClaimedJob, outcome: Outcome, seconds: float) -> None:
        """A transactional attempt ended: it started ``seconds`` ago, told now."""
        self.events.started(job, outcome.attempt, seconds)
        self.events.ended(job, outcome, seconds)

    def cancel(self, job_id: int) -> None:
        self.jobs.request_cancel(job_id)

    async def backpressure(self) -> None:
        """Stop claiming while the completer is far behind, or while the listener (and
        with it the liveness lock) is reconnecting."""
        worker, listener = self.worker, self.listener
        if worker.liveness_lock and worker.listen and not listener.connected.is_set():
            await listener.connected.wait()
        while self.completer.backlog > 4 * self.slots.total:
            await asyncio.sleep(0.001)

    @property
    def busy(self) -> int:
        """Slots running a job now, for the metrics (read from the scrape's thread)."""
        return self.jobs.running + len(self.sessions.running)
