"""The worker process: producers claim, the executor runs, the completer writes.

asyncio at the core. Async handlers run as tasks; sync handlers in a thread pool. One
LISTEN connection wakes producers; a slow poll makes notifications an optimisation only.
Every duty is a service of its own (the listener, the completer, the heartbeat, each
producer, and the leader's duties in leader.py) that one supervisor starts, restarts
with back-off when it raises, and counts (``Worker.service_restarts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from skiplock import executor
from skiplock.app import App
from skiplock.completer import Completer, fenced_batch
from skiplock.config import control_channel, done_channel, notify_channel
from skiplock.control import AdmitRequest, CancelRequest, ControlMessage, LimitsChanged, Wakeup
from skiplock.cursor import ClaimCursor
from skiplock.errors import ConfigurationError, SchemaNotReadyError
from skiplock.leadership import Leadership
from skiplock.metrics import NullMetrics
from skiplock.migrate import pending_migrations
from skiplock.pooler import WorkerConnections, check_worker_connections, resolve_poll_interval
from skiplock.retry import RetryPolicy
from skiplock.sql import claim, complete, maintenance, render, wakeup
from skiplock.tasks import MAX_QUEUE_NAME, check_name
from skiplock.types import ClaimedJob
from skiplock.waiting import wait_event
from skiplock.worker import job_log
from skiplock.worker.cancels import CancelRequests
from skiplock.worker.heartbeat import ClaimsInFlight, Heartbeat
from skiplock.worker.keepalives import DEFAULT_TCP_USER_TIMEOUT, with_keepalives
from skiplock.worker.leader import (
    Admission,
    Cron,
    CursorProbe,
    Election,
    History,
    Promotion,
    Rescue,
)
from skiplock.worker.leased import LeasedJobs
from skiplock.worker.limits import REFRESH_SECONDS as LIMITS_REFRESH_SECONDS
from skiplock.worker.limits import QueueLimits
from skiplock.worker.listener import Listener
from skiplock.worker.liveness import LivenessLock, session_kwargs
from skiplock.worker.producer import ClaimAhead, Producer, Slots
from skiplock.worker.sessions import TransactionalSessions
from skiplock.worker.starts import StartRecorder
from skiplock.worker.stats import WorkerStats
from skiplock.worker.supervisor import Every, Loop, Service, Supervisor
from skiplock.worker.timeouts import MAINTENANCE, WAKEUP, heartbeat_bounds
from skiplock.worker.wakeup import LateCommits, WakeupSession

log = logging.getLogger("skiplock.worker")

FINAL_WRITES_SECONDS = 15.0
# How often a busy worker looks for jobs that committed behind its claim cursor (decision
# 023): such a job waits at most about this long plus a claim.
LATE_COMMITS_SECONDS = 0.02
# Connections for the maintenance services: at most one each at a time.
MAINTENANCE_POOL_SIZE = 7
# How long a pool keeps retrying one lost connection before it gives up on that attempt
# and grows again when asked. psycopg_pool doubles the wait between tries without a cap
# until then (five minutes by default), so a worker let back in after a minute's outage
# would wait half a minute more for its next try; ended sooner, the tries stay a few
# seconds apart (tests/test_reconnect.py).
POOL_RECONNECT_SECONDS = 10.0
STARTUP_RETRY = RetryPolicy(base=0.5, factor=2.0, cap=15.0, jitter=0.5)


class Worker:
    """Runs jobs from ``queues`` with up to ``concurrency`` at a time in this process.

    ``lease_seconds`` bounds how long a job stays claimed by a worker that stops
    heartbeating; heartbeats extend it every third of that. ``poll_interval`` is the
    fallback when no notification arrives (default 1 s; 0.2 s without a listener).
    ``tcp_user_timeout`` (seconds) bounds how long a connection whose peer stopped
    answering (a cut link) looks alive: keepalives and libpq's ``tcp_user_timeout``
    are added to the URLs unless they set them (keepalives.py); None leaves the
    operating system's defaults.

    Behind a pooler in transaction mode (``pooler=True``: pooler.py), ``listen_url`` is a
    direct or session-mode URL for the listener and the heartbeat, which then hold the
    liveness lock; without it the worker polls and rescue waits for leases.
    ``listen=False`` runs without a LISTEN connection, polling.
    """

    def __init__(
        self,
        app: App,
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int = 10,
        poll_interval: float | None = None,
        lease_seconds: float = 30.0,
        shutdown_timeout: float = 30.0,
        batch_max: int = 100,
        transactional_batch: int = 10,
        rescue_interval: float = 1.0,
        sweep_interval: float = 5.0,
        leader_ttl: float = 10.0,
        history_retention: timedelta | None = timedelta(days=7),
        history_interval: float = 60.0,
        completer_interval: float = 0.002,
        admit_interval: float = 5.0,
        prefetch: int | None = None,
        liveness_lock: bool = True,
        metrics: NullMetrics | None = None,
        tcp_user_timeout: float | None = DEFAULT_TCP_USER_TIMEOUT,
        listen_url: str | None = None,
        listen: bool = True,
        pooler: bool = False,
    ) -> None:
        if not queues:
            raise ConfigurationError("a worker needs at least one queue")
        for queue in queues:
            check_name("queue", queue, MAX_QUEUE_NAME)
        if prefetch is not None and (
            not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0
        ):
            raise ConfigurationError(
                f"prefetch must be None (sized from job durations) or an integer >= 0, "
                f"got {prefetch!r}"
            )
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
        self.listen = check_worker_connections(pooler=pooler, listen=listen, listen_url=listen_url)
        poll_interval = resolve_poll_interval(poll_interval, self.listen)
        if lease_seconds <= 0 or poll_interval <= 0:
            raise ConfigurationError("lease_seconds and poll_interval must be positive")
        if tcp_user_timeout is not None and not tcp_user_timeout > 0:
            raise ConfigurationError(
                f"tcp_user_timeout must be positive seconds, or None for the operating "
                f"system's defaults, got {tcp_user_timeout!r}"
            )
        self.app = app
        self.queues = list(dict.fromkeys(queues))
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.lease_seconds = lease_seconds
        self.shutdown_timeout = shutdown_timeout
        self.batch_max = batch_max
        self.transactional_batch = transactional_batch
        self.rescue_interval = rescue_interval
        self.sweep_interval = sweep_interval
        self.leader_ttl = leader_ttl
        self.history_retention = history_retention
        self.history_interval = history_interval
        self.metrics = metrics or NullMetrics()
        self.completer_interval = completer_interval
        self.admit_interval = admit_interval
        self.tcp_user_timeout = tcp_user_timeout
        # Every connection the worker opens for itself gets the keepalives; handlers'
        # own connections are theirs.
        self.connections = WorkerConnections(
            with_keepalives(app.database_url, tcp_user_timeout),
            None if listen_url is None else with_keepalives(listen_url, tcp_user_timeout),
            pooler,
        )
        # Behind a pooler only the listener (on the listen URL) and the heartbeat can hold
        # the liveness lock; without a listener the worker is rescued by lease expiry.
        self.liveness_lock = liveness_lock and (not pooler or self.listen)
        # Jobs claimed beyond free capacity, waiting here (leased and heartbeated) for a
        # slot: their start then costs no claim round trip. None sizes it from how long
        # jobs and claims take (decision 018); a number caps it; 0 turns it off.
        self.prefetch = prefetch
        self.id: UUID = uuid4()
        self._rng = random.Random()
        self.leadership = Leadership(leader_ttl, self._rng)
        self.stats = WorkerStats()
        self.ready = asyncio.Event()
        self.completer: Completer | None = None
        self.supervisor: Supervisor | None = None
        self._listener: Listener | None = None
        self._heartbeat: Heartbeat | None = None
        self._admission: Admission | None = None
        self._cancels: CancelRequests | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: LeasedJobs | None = None
        # Lease-mode claims sent and not yet read: the heartbeat gives none of theirs back.
        self._claims = ClaimsInFlight()
        self._transactional: TransactionalSessions | None = None
        self._slots: Slots | None = None
        self._abandon = asyncio.Event()
        # This worker's queues that have a concurrency or rate limit, and their wake-ups.
        self._wake: dict[str, asyncio.Event] = {}
        self._wakeups: WakeupSession | None = None
        self._limits: QueueLimits | None = None
        # Sync handlers still running when shutdown gave up on them. Their threads cannot
        # be stopped, and Python waits for them at exit: the CLI exits hard instead.
        self.abandoned_threads = 0

    # -- lifecycle ---------------------------------------------------------------------

    def run(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down gracefully."""
        asyncio.run(self.run_async(handle_signals=True))

    def request_stop(self) -> None:
        """Ask the worker to stop claiming and shut down; safe from any thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)

    async def run_async(self, *, handle_signals: bool = False) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self._on_signal, signum)
        await self._wait_for_database()
        connections = self.connections
        url = connections.url
        schema = self.app.schema
        tx_async, tx_sync, leased_excluded = self._split_tasks()
        needs_async_sessions = any(tx_async.values())
        pool_size = 4 + len(self.queues) + (self.concurrency if needs_async_sessions else 0)
        # Every session of this worker holds its liveness lock: it lives while any does.
        # Behind a pooler only the listener and the heartbeat do (on the listen URL).
        liveness = LivenessLock(schema, self.id, enabled=self.liveness_lock)
        pooled_liveness = LivenessLock(
            schema, self.id, enabled=self.liveness_lock and connections.session_locks
        )
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            min_size=2,
            max_size=pool_size,
            kwargs={
                "autocommit": True,
                **connections.pooled(claim.WORKER_SESSION_OPTIONS),
                **session_kwargs("worker", self.id),
            },
            configure=pooled_liveness,
            open=False,
            name=f"skiplock-{self.id}",
            reconnect_timeout=POOL_RECONNECT_SECONDS,
        )
        # The leader's duties, promotion and the probe: every statement bounded, and
        # never waiting for a connection behind claims and outcomes (or they for it).
        maintenance_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=MAINTENANCE_POOL_SIZE,
            kwargs={
                "autocommit": True,
                **connections.pooled(MAINTENANCE.options()),
                **session_kwargs("maintenance", self.id),
            },
            configure=pooled_liveness,
            open=False,
            name=f"skiplock-{self.id}-maintenance",
            reconnect_timeout=POOL_RECONNECT_SECONDS,
        )
        sync_pool: ConnectionPool[Any] | None = None
        if any(tx_sync.values()):
            sync_pool = ConnectionPool(
                url,
                min_size=1,
                max_size=self.concurrency,
                kwargs={
                    "autocommit": True,
                    **connections.pooled(""),
                    **session_kwargs("transactional", self.id),
                },
                configure=pooled_liveness.take,
                open=False,
                reconnect_timeout=POOL_RECONNECT_SECONDS,
            )
            sync_pool.open()
        await pool.open()
        await maintenance_pool.open()
        threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="skiplock-job")
        slots = self._slots = Slots(self.concurrency)
        ahead = (
            None
            if self.prefetch == 0
            else ClaimAhead(slots, self.concurrency, most=self.batch_max, fixed=self.prefetch)
        )
        # When claiming ahead, run permits: jobs claimed ahead wait here for one, and a
        # transactional session takes one before it starts.
        gate = asyncio.Semaphore(self.concurrency) if ahead is not None else None
        wake = self._wake = {queue: asyncio.Event() for queue in self.queues}
        limits = self._limits = QueueLimits(pool, schema, self.queues, wake)
        self._transactional = TransactionalSessions(
            self.app,
            limits,
            batch=self.transactional_batch,
            poll_interval=self.poll_interval,
            rng=self._rng,
            on_claimed=self._claimed,
            on_completed=self._transactional_completed,
            on_finished=self._transactional_finished,
            gate=gate,
        )
        cursors = {queue: ClaimCursor() for queue in self.queues}
        # Inserts notify only while a worker waits on their queue (decision 023): through
        # its sentinel keys, held by this session, which also finds late commits.
        wakeups = self._wakeups = (
            WakeupSession(
                connections.dedicated_url,
                schema,
                connect_kwargs={
                    **connections.dedicated(WAKEUP.options(wakeup.WAKEUP_SESSION_OPTIONS)),
                    **session_kwargs("wakeup", self.id),
                },
                on_lost=lambda queue: wake[queue].set(),
            )
            if self.listen
            else None
        )
        self.metrics.worker_started(self._busy_slots, self.concurrency, self._leads)
        supervisor = self.supervisor = Supervisor(on_restart=self.metrics.service_restarted)

        # Without a listener nothing announces a job scheduled for later: promotion polls,
        # but at most every second (its statements are not free on an idle queue).
        promotion = Promotion(
            maintenance_pool,
            schema,
            poll_interval=self.poll_interval if self.listen else max(self.poll_interval, 1.0),
        )
        self.completer = completer = Completer(
            pool,
            schema,
            self.id,
            interval=self.completer_interval,
            max_batch=max(2 * self.concurrency, 100),
            on_retry_written=promotion.wake.set,
            on_flush=self._flushed,
        )
        jobs = self._jobs = LeasedJobs(
            self.app,
            self.id,
            limits,
            completer,
            self.stats,
            self.metrics,
            lease_seconds=self.lease_seconds,
            gate=gate,
            rng=self._rng,
            ahead=ahead,
        )
        admission = self._admission = Admission(
            maintenance_pool,
            schema,
            self.leadership,
            every=self.admit_interval,
            retry_after=min(self.rescue_interval, 1.0),
            on_admitted=self._admitted,
        )

        def on_wakeup(wakeup: Wakeup) -> None:
            later = wakeup.run_at is not None and wakeup.run_at > executor.utcnow()
            if wakeup.queue in cursors:
                cursors[wakeup.queue].rewind(wakeup)
                wake[wakeup.queue].set()
                if wakeups is not None and not later:
                    wakeups.woken(wakeup.queue)  # its producers claim now
            if later:
                promotion.wake.set()  # scheduled for later: recompute the next due time

        def on_connect() -> None:
            if wakeups is not None:
                wakeups.reset()  # its keys may have gone with the listener's server
            # Whatever was announced while the listener was away is unknown: sweep.
            for queue, cursor in cursors.items():
                cursor.force_sweep()
                wake[queue].set()
            promotion.wake.set()
            admission.ask_all()

        setup = (liveness.statement, liveness.params) if self.liveness_lock else None
        self._cancels = CancelRequests(
            pool, schema, self.id, leased=jobs.held, cancel=self.request_cancel
        )
        self._listener = listener = Listener(
            connections.dedicated_url,
            notify_channel(schema),
            on_wakeup,
            on_connect,
            setup=setup,
            control=(control_channel(schema), self._on_control),
            connect_kwargs={
                **connections.dedicated(""),
                **session_kwargs("listener", self.id),
            },
        )
        producers = self._producers(
            pool, sync_pool, cursors, leased_excluded, tx_async, tx_sync, threads, slots
        )
        heartbeat_every = max(self.lease_seconds / 3, 0.05)
        tick = min(self.rescue_interval, heartbeat_every)
        self._heartbeat = Heartbeat(
            connections.dedicated_url,
            schema,
            self.id,
            lease_seconds=self.lease_seconds,
            every=heartbeat_every,
            tick=tick,
            registration=self._registration,
            leased=jobs.held,
            take_progress=jobs.take_progress,
            request_cancel=jobs.request_cancel,
            on_lost=jobs.lost,
            on_connect=liveness,
            on_beat=jobs.confirmed,
            connect_kwargs=connections.dedicated(heartbeat_bounds(heartbeat_every).options()),
            claims=self._claims,
            # Stopping, nothing is given back but by the drain.
            settling=lambda: (
                None
                if self._stop is None or self._stop.is_set()
                else [*completer.pending_ids(), *jobs.giving_back()]
            ),
        )
        if ahead is not None:
            jobs.starts = StartRecorder(pool, schema, self.id, jobs.held)
        # Started once the liveness lock is held: until then a rescuer would take this
        # worker for dead, drop its registration and hand its jobs on, and an elected
        # leader without its lock could be replaced at any moment.
        rescue = Rescue(
            maintenance_pool,
            schema,
            self.id,
            self.leadership,
            tick=tick,
            expired_every=max(self.lease_seconds / 2, self.rescue_interval),
            on_rescued=self._rescued,
        )

        def elected() -> None:
            admission.ask_all()  # a new leader admits every waiting key
            rescue.wake.set()  # and rescues at once: the old leader may be the dead one

        services: list[Service] = [
            self._heartbeat,
            Election(
                maintenance_pool,
                schema,
                self.id,
                self.leadership,
                follower_every=self.rescue_interval,
                on_elected=elected,
            ),
            rescue,
            Cron(maintenance_pool, self.app, tick=tick),
            History(
                connections.dedicated_url,
                schema,
                self.leadership,
                tick=tick,
                every=self.history_interval,
                retention=self.history_retention,
                connect_kwargs=connections.dedicated(MAINTENANCE.options("")),
            ),
            admission,
            Every("limits", LIMITS_REFRESH_SECONDS, limits.read),
        ]
        if jobs.starts is not None:
            services.append(jobs.starts)
        supervisor.start(self._cancels)
        if self.listen:
            supervisor.start(listener)
        supervisor.start(Loop("completer", completer.run))
        supervisor.start(promotion)
        if wakeups is not None:
            supervisor.start(
                LateCommits(
                    wakeups,
                    schema,
                    cursors,
                    leased_excluded,
                    every=LATE_COMMITS_SECONDS,
                    on_found=lambda queue: wake[queue].set(),
                )
            )
        supervisor.start(
            CursorProbe(
                maintenance_pool,
                schema,
                cursors,
                leased_excluded,
                every=self.sweep_interval,
                on_found=lambda queue: wake[queue].set(),
            )
        )
        try:
            if self.listen:
                await self._until_stopped(listener.connected.wait())
            else:
                on_connect()  # nothing announced: sweep and look at everything once
            await self._register(maintenance_pool)
            await limits.read()
            for service in services:
                supervisor.start(service)
            for producer in producers:
                supervisor.start(producer)
            self.ready.set()
            log.info(
                "worker %s started: queues=%s concurrency=%d",
                self.id,
                self.queues,
                self.concurrency,
            )
            if not self.listen:
                log.info(
                    "no listener: polling every %gs; %s",
                    self.poll_interval,
                    "liveness lock on this worker's sessions"
                    if self.liveness_lock
                    else "no liveness lock: a dead worker's jobs wait for their lease",
                )
            await self._stop.wait()
            log.info("worker %s stopping: waiting for %d running jobs", self.id, slots.busy)
        finally:
            if self._transactional is not None:
                self._transactional.stop()  # no batch starts another job (decision 002)
            await supervisor.stop(p.name for p in producers)
            if wakeups is not None:
                # Nothing here claims any more: the queue's other workers take over.
                with contextlib.suppress(psycopg.Error):
                    await wakeups.hand_over()
            # A claim in flight when its producer was cancelled still delivers its jobs.
            in_flight = [p.pending for p in producers if p.pending and not p.pending.done()]
            await asyncio.gather(*in_flight, return_exceptions=True)
            # Heartbeats and the completer keep running while jobs finish.
            await self._drain(completer, pool)
            await supervisor.stop()
            # Bounded like every maintenance statement: a user's lock on the leader row
            # must not keep the process from exiting (the row then simply expires).
            with contextlib.suppress(psycopg.Error):
                async with maintenance_pool.connection() as conn:
                    await conn.execute(
                        render(maintenance.WORKER_DEREGISTER, schema), {"id": self.id}
                    )
                    await conn.execute(
                        render(maintenance.LEADER_RESIGN, schema), {"worker_id": self.id}
                    )
            if wakeups is not None:
                await wakeups.close()
            await maintenance_pool.close()
            await pool.close()
            if sync_pool is not None:
                sync_pool.close()
            threads.shutdown(wait=False, cancel_futures=True)
            self.metrics.worker_stopped()
            log.info("worker %s stopped", self.id)

    def _producers(
        self,
        pool: AsyncConnectionPool[Any],
        sync_pool: ConnectionPool[Any] | None,
        cursors: dict[str, ClaimCursor],
        leased_excluded: list[str],
        tx_async: dict[str, list[str]],
        tx_sync: dict[str, list[str]],
        threads: ThreadPoolExecutor,
        slots: Slots,
    ) -> list[Producer]:
        """Per queue, a producer of lease-mode claims, and one per kind of transactional
        session (async, sync) when the queue has such tasks."""
        sessions, jobs = self._transactional, self._jobs
        assert sessions is not None and jobs is not None
        producers: list[Producer] = []
        for queue in self.queues:
            wake = self._wake[queue]
            producers.append(
                Producer(
                    f"{queue}/lease",
                    self._claims.track(
                        jobs.fetch(pool, queue, cursors[queue], leased_excluded, threads, slots)
                    ),
                    slots,
                    wake,
                    batch_max=self.batch_max,
                    poll_interval=self.poll_interval,
                    backpressure=self._backpressure,
                    ahead=jobs.ahead,
                    queue=queue,
                    waiting=self._wakeups,
                )
            )
            if tx_async[queue]:
                producers.append(
                    sessions.producer(
                        queue,
                        slots,
                        wake,
                        sessions.async_session(pool, queue, tx_async[queue], slots),
                        in_thread=False,
                        waiting=self._wakeups,
                    )
                )
            if tx_sync[queue] and sync_pool is not None:
                producers.append(
                    sessions.producer(
                        queue,
                        slots,
                        wake,
                        sessions.sync_session(sync_pool, queue, tx_sync[queue], slots, threads),
                        in_thread=True,
                        waiting=self._wakeups,
                    )
                )
        return producers

    @property
    def service_restarts(self) -> dict[str, int]:
        """Restarts per service since the worker started (a service restarts when it
        raised something it does not handle itself; the traceback is in the log)."""
        return dict(self.supervisor.restarts) if self.supervisor is not None else {}

    def _on_signal(self, signum: int) -> None:
        assert self._stop is not None
        if self._stop.is_set():
            log.warning("second %s: releasing running jobs now", signal.Signals(signum).name)
            self._abandon.set()
        self._stop.set()

    async def _wait_for_database(self) -> None:
        """Check the schema, retrying with back-off while the database is unreachable."""
        failures = 0
        while True:
            try:
                pending = await asyncio.to_thread(
                    _pending_versions,
                    self.app.database_url,
                    self.app.schema,
                    # As the claims connect: a pooler that refuses them is told here.
                    self.connections.pooled(claim.WORKER_SESSION_OPTIONS),
                )
                if pending:
                    raise SchemaNotReadyError(
                        f"schema {self.app.schema!r} is missing migrations {pending}; "
                        "run `skiplock migrate` first"
                    )
                return
            except psycopg.OperationalError as exc:
                failures += 1
                delay = STARTUP_RETRY.delay(failures, self._rng)
                log.error(
                    "cannot reach the database (%s); retrying in %.1fs", str(exc).strip(), delay
                )
                assert self._stop is not None
                await wait_event(self._stop, delay)
                if self._stop.is_set():
                    raise

    def _split_tasks(
        self,
    ) -> tuple[dict[str, list[str]], dict[str, list[str]], list[str]]:
        """Per queue, the transactional tasks (async and sync), and every transactional
        task name, which lease-mode claims must leave alone."""
        tx_async: dict[str, list[str]] = {q: [] for q in self.queues}
        tx_sync: dict[str, list[str]] = {q: [] for q in self.queues}
        transactional: list[str] = []
        for task in self.app.tasks.values():
            if not task.options.transactional:
                continue
            transactional.append(task.name)
            if task.options.queue in tx_async:
                (tx_async if task.is_async else tx_sync)[task.options.queue].append(task.name)
        return tx_async, tx_sync, transactional

    async def _until_stopped(self, awaitable: Any) -> None:
        """Await ``awaitable`` unless the worker is asked to stop first."""
        assert self._stop is not None
        waiter = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for future in (waiter, stopper):
            future.cancel()

    async def _backpressure(self) -> None:
        """Stop claiming while the completer is far behind, or while the listener (and
        with it the liveness lock) is reconnecting."""
        listener = self._listener
        if (
            self.liveness_lock
            and self.listen
            and listener is not None
            and not listener.connected.is_set()
        ):
            await listener.connected.wait()
        completer, slots = self.completer, self._slots
        capacity = self.concurrency if slots is None else slots.total
        while completer is not None and completer.backlog > 4 * capacity:
            await asyncio.sleep(0.001)

    def _claimed(self, queue: str, count: int) -> None:
        self.stats.claimed += count
        self.metrics.claimed(queue, count)

    def _busy_slots(self) -> int:
        """Slots running a job now, for the metrics (read from the scrape's thread)."""
        jobs, sessions = self._jobs, self._transactional
        leased = jobs.running if jobs is not None else 0
        return leased + (len(sessions.running) if sessions is not None else 0)

    def _leads(self) -> bool:
        """Whether this worker is the elected leader now (from any thread: the event
        loop's clock is the monotonic clock)."""
        return self._loop is not None and self.leadership.is_leader(self._loop.time())

    def _transactional_completed(self, count: int) -> None:
        self.stats.transactional_completed += count

    def _transactional_finished(
        self, job: ClaimedJob, kind: str, seconds: float, error: dict[str, Any] | None
    ) -> None:
        self.metrics.job_started(job, job.attempts + 1, seconds)
        self.metrics.job_finished(job.queue, job.task, kind, seconds)
        if error is not None:
            self.metrics.job_failed(job.queue, job.task, error)
        job_log.transactional_finished(job, kind, seconds, error)

    def request_cancel(self, job_id: int) -> None:
        """Stop a running job of this worker: async handlers are cancelled, sync handlers
        see ``skiplock.cancel_requested()`` turn true. The job ends cancelled."""
        if self._jobs is not None:
            self._jobs.request_cancel(job_id)

    def _on_control(self, message: ControlMessage) -> None:
        """A message from the control channel, where anyone can write (control.py): none
        is taken at its word. A cancel is confirmed by the job's row first; admission
        and limits are read from the tables, and requests for them are coalesced."""
        if isinstance(message, CancelRequest):
            if self._cancels is not None:
                self._cancels.ask(message.job_id)
        elif isinstance(message, AdmitRequest):
            if self._admission is not None:
                self._admission.ask(message.key or "")
        elif isinstance(message, LimitsChanged) and self._limits is not None:
            self._limits.read_soon()

    def _flushed(self, batch: int, refused: int) -> None:
        self.metrics.flushed(batch, refused)
        if self._limits is not None:
            self._limits.room_freed()

    # -- heartbeat, rescue, shutdown ---------------------------------------------------

    def _registration(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queues": self.queues,
            "concurrency": self.concurrency,
            "holds_lock": self.liveness_lock,
            # Leases further ahead than this were not written by this worker (0019).
            "lease_seconds": self.lease_seconds,
            # Only the services that were restarted: a healthy worker reports {}.
            "service_restarts": Jsonb({k: n for k, n in self.service_restarts.items() if n}),
        }

    async def _register(self, pool: AsyncConnectionPool[Any]) -> None:
        async with pool.connection() as conn:
            await conn.execute(
                render(maintenance.WORKER_REGISTER, self.app.schema), self._registration()
            )

    async def heartbeat(self) -> None:
        """Extend this worker's leases now (the heartbeat service does it every third of
        the lease); stop jobs whose lease was lost."""
        assert self._heartbeat is not None, "the worker is not running"
        await self._heartbeat.beat()

    def _rescued(self, count: int) -> None:
        self.metrics.rescued(count)
        self.stats.rescued += count

    def _admitted(self, count: int) -> None:
        self.stats.admitted += count

    async def _drain(self, completer: Completer, pool: AsyncConnectionPool[Any]) -> None:
        """Let running jobs finish (up to the shutdown timeout), then write every outcome.

        Jobs still running at the timeout are released: back to the queue at once with
        the attempt given back (it was cut short, not failed) and a WorkerShutdown note.
        """
        jobs, sessions = self._jobs, self._transactional
        assert jobs is not None and sessions is not None
        unfinished: dict[int, int] = {}
        # Jobs claimed ahead that never started go back now, before the running jobs are
        # waited for: another worker can run them meanwhile (decision 018).
        jobs.give_back_waiting()
        running = [task for _, task in jobs.held.values()] + list(sessions.running)
        if running:
            finished = asyncio.ensure_future(
                asyncio.wait(running, timeout=max(self.shutdown_timeout, 0.001))
            )
            abandoned = asyncio.ensure_future(self._abandon.wait())
            await asyncio.wait({finished, abandoned}, return_when=asyncio.FIRST_COMPLETED)
            abandoned.cancel()
            still = {task for task in running if not task.done()}
            for job_id, (attempt, task) in list(jobs.held.items()):
                if task in still:
                    unfinished[job_id] = attempt
                    if jobs.runs_in_thread(job_id):
                        self.abandoned_threads += 1  # a thread cannot be cancelled
                    del jobs.held[job_id]
                    task.cancel()
            # Their running jobs cut short, the batches commit what finished before them.
            self.abandoned_threads += await sessions.cut_short()
        # Bounded: a write stuck behind a lock must not keep the process from exiting.
        # Whatever is not written here is rescued (liveness, or lease expiry) and re-run.
        deadline = asyncio.get_running_loop().time() + FINAL_WRITES_SECONDS
        while asyncio.get_running_loop().time() < deadline:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(jobs.given_back_written(), remaining)
                if completer.backlog:
                    # The completer service writes them: one flusher at a time, or two
                    # would write (and then drop) the same batch.
                    await asyncio.wait_for(completer.wait_drained(), remaining)
                if unfinished:
                    await asyncio.wait_for(self._release(pool, unfinished), remaining)
                    unfinished = {}
                if not completer.backlog:
                    return
            except (TimeoutError, psycopg.Error) as exc:
                # Any database error, not only a lost connection: retried until the deadline.
                log.warning("final writes failed (%r); retrying", exc)
                await asyncio.sleep(0.2)
        log.error(
            "gave up writing %d outcomes at shutdown; their jobs will be rescued and re-run",
            completer.backlog + len(unfinished),
        )

    async def _release(self, pool: AsyncConnectionPool[Any], jobs: dict[int, int]) -> None:
        async with pool.connection() as conn:
            cur = await conn.execute(
                render(complete.JOB_RELEASE_MANY_IF_LEASED, self.app.schema),
                {
                    **fenced_batch({job_id: {"attempt": a} for job_id, a in jobs.items()}),
                    "worker_id": self.id,
                    "channel": notify_channel(self.app.schema),
                },
            )
            rows = await cur.fetchall()
            released = sum(int(row[1]) for row in rows if row[0] is not None)
            cancelled = sum(int(row[1]) for row in rows if row[0] is None)
            if cancelled:
                await conn.execute(
                    render(complete.JOBS_DONE_NOTIFY, self.app.schema),
                    {"channel": done_channel(self.app.schema)},
                )
        log.warning("released %d unfinished jobs back to their queues", released)
        if cancelled:
            log.warning("ended %d unfinished jobs cancelled, as was asked", cancelled)


def _pending_versions(url: str, schema: str, connect_kwargs: dict[str, Any]) -> list[int]:
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=10, **connect_kwargs)
    except psycopg.OperationalError as exc:
        if "unsupported startup parameter" in str(exc):
            # PgBouncer: retrying would only fail the same way, and quietly in the pools.
            raise ConfigurationError(
                f"the database URL refused the worker's session settings ({str(exc).strip()}): "
                "a pooler such as PgBouncer; start the worker with --pooler (pooler=True), "
                "and --listen-url with a direct or session-mode URL for LISTEN and liveness"
            ) from exc
        raise
    with conn:
        return [m.version for m in pending_migrations(conn, schema)]
