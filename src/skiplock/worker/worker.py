"""The worker process: producers claim, the executor runs, the completer writes.

asyncio at the core. Async handlers run as tasks; sync handlers in a thread pool. One
LISTEN connection wakes producers; a slow poll makes notifications an optimisation only.
Every duty is a service of its own (the listener, the completer, the heartbeat, each
producer, and the leader's duties in leader.py) that one supervisor starts, restarts
with back-off when it raises, and counts (``Worker.service_restarts``).

A run reads in four places: the options (options.py), the pools (pools.py), the parts and
their wiring (assembly.py), and the graceful stop (shutdown.py). This module holds the
worker's identity and lifecycle, and receives what the parts report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import signal
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from uuid import UUID, uuid4

import psycopg
from psycopg.types.json import Jsonb

from skiplock.app import App
from skiplock.control import AdmitRequest, CancelRequest, ControlMessage, LimitsChanged
from skiplock.errors import ConfigurationError, SchemaNotReadyError
from skiplock.leadership import Leadership
from skiplock.metrics import Metrics, NullMetrics
from skiplock.migrate import pending_migrations
from skiplock.pooler import WorkerConnections
from skiplock.retry import RetryPolicy
from skiplock.sql import claim, maintenance, render
from skiplock.waiting import wait_event
from skiplock.wording import plural
from skiplock.worker.assembly import Parts, TaskSplit
from skiplock.worker.heartbeat import ClaimsInFlight
from skiplock.worker.keepalives import with_keepalives
from skiplock.worker.liveness import LivenessLock
from skiplock.worker.options import WorkerOptions
from skiplock.worker.pools import WorkerPools
from skiplock.worker.shutdown import shut_down
from skiplock.worker.stats import WorkerStats

if TYPE_CHECKING:
    from skiplock.completer import Completer
    from skiplock.worker.supervisor import Supervisor

log = logging.getLogger("skiplock.worker")

STARTUP_RETRY = RetryPolicy(base=0.5, factor=2.0, cap=15.0, jitter=0.5)


def _serving_default_database(app: App, queues: Sequence[str]) -> App:
    """A Worker serves one database: with routes, its queues must all live on the App's
    database_url, and it runs as the App bound there (so that it ticks only the
    schedules of queues on that database). Queues elsewhere are refused, naming the
    worker that serves several databases."""
    elsewhere = [queue for queue in queues if app.database_url_for(queue) != app.database_url]
    if elsewhere:
        names = ", ".join(repr(queue) for queue in elsewhere)
        raise ConfigurationError(
            f"queues {names} live on other databases of this App (queue_databases), and a "
            "skiplock.Worker serves one database: run skiplock.worker.routed.RoutedWorker("
            "app, queues=[...]) instead, a Worker per database in one process (as "
            "`skiplock worker` does)"
        )
    return app._for_database(app.database_url)


class Worker:
    """Runs jobs from its queues, up to ``concurrency`` at a time in this process.

    ``Worker(app, WorkerOptions(...))``, or the same options as keywords
    (``Worker(app, queues=["emails"], concurrency=4)``): worker/options.py documents
    each. ``metrics`` receives the worker's counters (metrics.py).
    """

    def __init__(
        self,
        app: App,
        options: WorkerOptions | None = None,
        *,
        metrics: Metrics | None = None,
        **fields: Any,
    ) -> None:
        if fields:
            known = {f.name for f in dataclasses.fields(WorkerOptions)}
            unknown = sorted(set(fields) - known)
            if unknown:
                raise TypeError(
                    f"Worker() got unknown options {', '.join(unknown)}; "
                    f"known: {', '.join(sorted(known))}"
                )
            options = dataclasses.replace(options or WorkerOptions(), **fields)
        options = options or WorkerOptions()
        if app.queue_databases:
            app = _serving_default_database(app, options.queues)
        self.app = app
        self.options = options
        self.metrics: Metrics = metrics or NullMetrics()
        # The options as they apply together (options.py).
        self.queues = list(options.queues)
        self.concurrency = options.concurrency
        self.lease_seconds = options.lease_seconds
        self.listen = options.listens
        self.poll_interval = options.poll_seconds
        self.liveness_lock = options.holds_liveness_lock
        # Every connection the worker opens for itself gets the keepalives; handlers'
        # own connections are theirs.
        listen_url = options.listen_url
        self.connections = WorkerConnections(
            with_keepalives(app.database_url, options.tcp_user_timeout),
            None if listen_url is None else with_keepalives(listen_url, options.tcp_user_timeout),
            options.pooler,
        )
        self.id: UUID = uuid4()
        self.rng = random.Random()
        self.leadership = Leadership(options.leader_ttl, self.rng)
        self.stats = WorkerStats()
        self.ready = asyncio.Event()
        # Lease-mode claims sent and not yet read: the heartbeat gives none of theirs back.
        self.claims = ClaimsInFlight()
        # The services of the current run (assembly.py); None until it starts.
        self.parts: Parts | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals_handled = False
        self._abandon = asyncio.Event()
        # Sync handlers still running when shutdown gave up on them. Their threads cannot
        # be stopped, and Python waits for them at exit: the CLI exits hard instead.
        self.abandoned_threads = 0

    @property
    def stopping(self) -> bool:
        return self._stop is None or self._stop.is_set()

    @property
    def completer(self) -> Completer | None:
        return self.parts.completer if self.parts is not None else None

    @property
    def supervisor(self) -> Supervisor | None:
        return self.parts.supervisor if self.parts is not None else None

    # -- lifecycle ---------------------------------------------------------------------

    def run(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down gracefully."""
        asyncio.run(self.run_async(handle_signals=True))

    def request_stop(self) -> None:
        """Ask the worker to stop claiming and shut down; safe from any thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)

    async def run_async(self, *, handle_signals: bool = False) -> None:
        """Run until ``request_stop`` (or a signal, with ``handle_signals``), then shut
        down gracefully (worker/shutdown.py)."""
        self._prepare(handle_signals)
        await self._wait_for_database()
        split = TaskSplit.of(self.app, self.options.queues)
        async with self._pools(split) as pools:
            parts = self.parts = Parts(self, pools, split)
            self.metrics.worker_started(self._busy_slots, self.concurrency, self._leads)
            parts.start_hearing()
            try:
                await self._start(parts)
                assert self._stop is not None
                await self._stop.wait()
                log.info(
                    "worker %s stopping: waiting up to %gs for %s to finish%s",
                    self.id,
                    self.options.shutdown_timeout,
                    plural(parts.slots.busy, "running job"),
                    "; a second Ctrl-C (or SIGTERM) gives them back at once"
                    if self._signals_handled and parts.slots.busy
                    else "",
                )
            finally:
                self.abandoned_threads += await shut_down(parts, abandon=self._abandon)
        self.metrics.worker_stopped()
        log.info("worker %s stopped", self.id)

    def _prepare(self, handle_signals: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._signals_handled = handle_signals
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self._on_signal, signum)

    def _pools(self, split: TaskSplit) -> WorkerPools:
        # Behind a pooler only the listener and the heartbeat hold the liveness lock
        # (on the listen URL): pooled sessions hold it only on direct connections.
        liveness = LivenessLock(
            self.app.schema,
            self.id,
            enabled=self.liveness_lock and self.connections.session_locks,
        )
        return WorkerPools(
            self.options,
            self.connections,
            self.id,
            liveness,
            async_sessions=split.async_sessions,
            sync_sessions=split.sync_sessions,
        )

    async def _start(self, parts: Parts) -> None:
        """Hold the liveness lock (through the listener), register, then start claiming."""
        if self.listen:
            await self._until_stopped(parts.listener.connected.wait())
        else:
            parts.on_connect()  # nothing announced: sweep and look at everything once
        await self._register(parts)
        await parts.limits.read()
        parts.start_working()
        self.ready.set()
        log.info(
            "worker %s started: queues=%s concurrency=%d", self.id, self.queues, self.concurrency
        )
        if not self.listen:
            log.info(
                "no listener: polling every %gs; %s",
                self.poll_interval,
                "liveness lock on this worker's sessions"
                if self.liveness_lock
                else "no liveness lock: a dead worker's jobs wait for their lease",
            )

    @property
    def service_restarts(self) -> dict[str, int]:
        """Restarts per service since the worker started (a service restarts when it
        raised something it does not handle itself; the traceback is in the log)."""
        supervisor = self.supervisor
        return dict(supervisor.restarts) if supervisor is not None else {}

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
                delay = STARTUP_RETRY.delay(failures, self.rng)
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                if failures == 1:
                    log.warning(
                        "cannot reach the database (%s); retrying until it answers, at "
                        "most %gs apart (Ctrl-C stops)",
                        reason,
                        STARTUP_RETRY.cap,
                    )
                else:
                    log.warning(
                        "still cannot reach the database after %d tries (%s); next in %.1fs",
                        failures,
                        reason,
                        delay,
                    )
                assert self._stop is not None
                await wait_event(self._stop, delay)
                if self._stop.is_set():
                    raise

    async def _until_stopped(self, awaitable: Any) -> None:
        """Await ``awaitable`` unless the worker is asked to stop first."""
        assert self._stop is not None
        waiter = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for future in (waiter, stopper):
            future.cancel()

    # -- what the parts report ------------------------------------------------------------

    def _busy_slots(self) -> int:
        """Slots running a job now, for the metrics (read from the scrape's thread)."""
        return self.parts.busy if self.parts is not None else 0

    def _leads(self) -> bool:
        """Whether this worker is the elected leader now (from any thread: the event
        loop's clock is the monotonic clock)."""
        return self._loop is not None and self.leadership.is_leader(self._loop.time())

    def transactional_completed(self, count: int) -> None:
        self.stats.transactional_completed += count

    def request_cancel(self, job_id: int) -> None:
        """Stop a running job of this worker: async handlers are cancelled, sync handlers
        see ``skiplock.cancel_requested()`` turn true. The job ends cancelled."""
        if self.parts is not None:
            self.parts.cancel(job_id)

    def on_control(self, message: ControlMessage) -> None:
        """A message from the control channel, where anyone can write (control.py): none
        is taken at its word. A cancel is confirmed by the job's row first; admission
        and limits are read from the tables, and requests for them are coalesced."""
        parts = self.parts
        if parts is None:
            return
        if isinstance(message, CancelRequest):
            parts.cancels.ask(message.job_id)
        elif isinstance(message, AdmitRequest):
            parts.admission.ask(message.key or "")
        elif isinstance(message, LimitsChanged):
            parts.limits.read_soon()

    def flushed(self, batch: int, refused: int) -> None:
        self.metrics.flushed(batch, refused)
        if self.parts is not None:
            self.parts.limits.room_freed()

    def rescued(self, count: int) -> None:
        self.metrics.rescued(count)
        self.stats.rescued += count

    def admitted(self, count: int) -> None:
        self.stats.admitted += count

    # -- registration and heartbeat -----------------------------------------------------

    def registration(self) -> dict[str, Any]:
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

    async def _register(self, parts: Parts) -> None:
        async with parts.pools.maintenance.connection() as conn:
            await conn.execute(
                render(maintenance.WORKER_REGISTER, self.app.schema), self.registration()
            )

    async def heartbeat(self) -> None:
        """Extend this worker's leases now (the heartbeat service does it every third of
        the lease); stop jobs whose lease was lost."""
        assert self.parts is not None, "the worker is not running"
        await self.parts.heartbeat.beat()


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
