"""Batched, fenced writes of job outcomes.

Handlers finish one by one; their outcomes are written together, one statement per
outcome kind per flush. A crash before a flush loses only the outcomes, never the jobs:
their leases expire and they run again (at-least-once).

One bad row stays one bad row: every string is made storable before it is written
(skiplock.storable), and should PostgreSQL still refuse a batch for something other than
a lost connection, the batch is split in halves until the refused outcome is alone; that
one is recorded as a failed attempt with PostgreSQL's reason, and the rest are written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from skiplock.config import done_channel, results_notice
from skiplock.outcomes import OUTCOME_TYPES, Completed, Outcome
from skiplock.retry import RetryPolicy
from skiplock.sql import complete, render
from skiplock.storable import storable_error, storable_json_text, storable_message

log = logging.getLogger("skiplock.completer")

RECONNECT = RetryPolicy(base=0.05, factor=2.0, cap=2.0, jitter=0.5)
# The back-off of an attempt whose outcome PostgreSQL refused: the job's own policy is not
# known here, so the default one (as RetryPolicy()).
REFUSED_BACKOFF = RetryPolicy()


# One statement per group of outcomes, each over parallel arrays (outcomes.py).
_STATEMENTS = {kind.group: kind.statements[0] for kind in OUTCOME_TYPES}
# The same, each committing alone: a flush of one group is that one statement.
_ALONE = {kind.group: kind.statements[1] for kind in OUTCOME_TYPES}


def fenced_batch(entries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Parameters of a fenced batch statement: the ids, and each job's own values keyed by
    id (sql/complete.py, ROBUST_LOOKUP).

    The ids go as the text of an array, which every statement casts (``::bigint[]``):
    psycopg dumps a list element by element in Python, about 0.8 us a job, and types it
    by its largest element, so that one statement was prepared once for ids up to 32767
    and again for larger ones."""
    keys = [str(k) for k in entries]
    return {
        "ids": "{" + ",".join(keys) + "}",
        "batch": Jsonb(dict(zip(keys, entries.values(), strict=True))),
    }


def storable_outcome(outcome: Outcome) -> Outcome:
    """``outcome`` with its error record's strings made storable, and its progress left
    out when PostgreSQL could not store it (it is a side note; the outcome is not). Pure."""
    if outcome.error is None and outcome.progress_json is None:
        return outcome  # nothing to check: a success without progress, most outcomes
    changes: dict[str, Any] = {}
    if outcome.error is not None:
        error = storable_error(outcome.error)
        if error != outcome.error:
            changes["error"] = error
    if not storable_json_text(outcome.progress_json):
        changes["progress_json"] = None
    return dataclasses.replace(outcome, **changes) if changes else outcome


def refused_error(outcome: Outcome, refusal: BaseException, now: str) -> dict[str, Any]:
    """The error recorded for an attempt whose outcome PostgreSQL refused. Pure."""
    what = "result" if isinstance(outcome, Completed) else "outcome"
    return {
        "attempt": outcome.attempt,
        "at": now,
        "type": "OutcomeNotStorableError",
        "message": f"{what} not storable: {storable_message(refusal)}",
        "traceback": None,
    }


def _lost_connection(exc: BaseException) -> bool:
    """A failure of the connection, not of the rows: the same batch is tried again."""
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)


def _refused_for_its_rows(exc: BaseException) -> bool:
    """A refusal some row of the batch caused: a value PostgreSQL would not take (class 22),
    a constraint (class 23), or a value psycopg could not send. Any other error (a lost
    connection, a missing table or privilege) is the same for every row: bisecting would
    only repeat it, so the batch is kept and tried again."""
    if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
        return True
    return not isinstance(exc, psycopg.Error)


def outcome_writes(batch: Sequence[Outcome]) -> list[tuple[str, dict[str, Any]]]:
    """The statements (by group) and parameters that write ``batch``; pure."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for outcome in batch:
        groups.setdefault(outcome.group, {})[outcome.job_id] = outcome.entry()
    return [(group, fenced_batch(entries)) for group, entries in groups.items()]


@dataclass
class CompleterStats:
    completed: int = 0
    retried: int = 0
    snoozed: int = 0
    cancelled: int = 0
    dead: int = 0
    refused: int = 0
    # Outcomes PostgreSQL would not take, recorded as failed attempts instead.
    unstorable: int = 0
    # Outcomes not even a plain failure could be written for: their leases expire.
    dropped: int = 0
    flushes: int = 0


@dataclass
class _Flush:
    """How far one flush got: the outcomes settled so far (the batch's head, in order), and
    which of them were written, recorded as failures instead, or could not be written."""

    settled: list[Outcome] = field(default_factory=list)
    written: set[int] = field(default_factory=set)
    unstorable: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Completer:
    """Collects outcomes and writes them every ``interval`` seconds or ``max_batch`` items.

    ``run`` flushes in the background; the shutdown drain calls ``flush`` too. A lock makes
    them take turns, so no batch is ever written twice."""

    pool: AsyncConnectionPool[Any]
    schema: InitVar[str]
    worker_id: UUID
    _: KW_ONLY
    interval: float = 0.002
    max_batch: int = 2000
    on_retry_written: Callable[[], None] = lambda: None
    on_flush: Callable[[int, int], None] = lambda batch, refused: None
    _sql: dict[str, str] = field(init=False)
    _alone_sql: dict[str, str] = field(init=False)
    _refused_sql: str = field(init=False)
    _durable_sql: str = field(init=False)
    _results_notice: tuple[str, dict[str, str]] = field(init=False)
    _done_channel: str = field(init=False)
    _pending: list[Outcome] = field(init=False, default_factory=list)
    _ready: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _drained: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _flushing: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    _rng: random.Random = field(init=False, default_factory=random.Random)
    stats: CompleterStats = field(init=False, default_factory=CompleterStats)
    refused_ids: list[int] = field(init=False, default_factory=list)

    def __post_init__(self, schema: str) -> None:
        self._sql = {group: render(statement, schema) for group, statement in _STATEMENTS.items()}
        self._alone_sql = {group: render(statement, schema) for group, statement in _ALONE.items()}
        self._refused_sql = render(complete.JOB_FAIL_UNSTORABLE_IF_LEASED, schema)
        self._durable_sql = render(complete.DURABLE_COMMIT_ON, schema)
        self._results_notice = results_notice(schema)
        self._done_channel = done_channel(schema)
        self._drained.set()

    def add(self, outcome: Outcome) -> None:
        self._pending.append(outcome)
        self._drained.clear()
        self._ready.set()

    @property
    def backlog(self) -> int:
        return len(self._pending)

    def pending_ids(self) -> set[int]:
        """Jobs whose outcome is not written yet: still running in the database, and this
        worker's (the heartbeat must not give them back)."""
        return {outcome.job_id for outcome in self._pending}

    async def wait_drained(self) -> None:
        await self._drained.wait()

    async def run(self) -> None:
        """Flush until cancelled. Waits a moment after the first outcome to gather more."""
        failures = 0
        while True:
            await self._ready.wait()
            if len(self._pending) < self.max_batch:
                await asyncio.sleep(self.interval)
            try:
                await self.flush()
                failures = 0
            except Exception as exc:
                # A lost connection, or an error no row caused (flush isolates those that
                # one did): the batch is kept and written once the database takes it.
                failures += 1
                delay = RECONNECT.delay(failures, self._rng)
                if _lost_connection(exc):
                    log.warning("writing outcomes failed (%s); retrying in %.2fs", exc, delay)
                else:
                    log.exception("writing outcomes failed; retrying in %.2fs", delay)
                await asyncio.sleep(delay)

    async def flush(self) -> None:
        """Write up to ``max_batch`` pending outcomes. An outcome refused for its values is
        recorded as a failed attempt and the others are written; on a lost connection (or
        another error no row caused) whatever was not written yet stays pending, and the
        error is raised."""
        async with self._flushing:
            batch = [storable_outcome(o) for o in self._pending[: self.max_batch]]
            if not batch:
                self._ready.clear()
                self._drained.set()
                return
            progress = _Flush()
            try:
                await self._write_isolated(batch, progress)
            finally:
                # Whatever was settled (written, refused by its fence, or recorded as a
                # failure) leaves the queue, even when a lost connection cut the flush short.
                self._settle(progress)

    def _settle(self, progress: _Flush) -> None:
        settled, written, unstorable = progress.settled, progress.written, progress.unstorable
        if not settled:
            return
        # Halves are written left first, so what is settled is always the batch's head,
        # and the batch is the head of the queue (add only appends; flushes take turns).
        del self._pending[: len(settled)]
        stats = self.stats
        stats.flushes += 1
        # One pass over the flush (a kind read once per outcome); then, as ever, the
        # flush's callbacks before its counts and warnings.
        dropped = progress.dropped
        refused: list[Outcome] = []
        kinds: dict[str, int] = {}
        found_unstorable = found_dropped = 0
        retry_written = bool(unstorable)
        for outcome in settled:
            kind = outcome.kind
            if kind == "retried" or (kind == "snoozed" and outcome.delay > 0):
                retry_written = True
            job_id = outcome.job_id
            if job_id in unstorable:
                found_unstorable += 1
            elif job_id in dropped:
                found_dropped += 1
            elif job_id not in written:
                if not getattr(outcome, "by_handler", False):
                    refused.append(outcome)
            else:
                kinds[kind] = kinds.get(kind, 0) + 1
        self.on_flush(len(settled), len(refused))
        if retry_written:
            self.on_retry_written()
        stats.unstorable += found_unstorable
        stats.dropped += found_dropped
        for outcome in refused:
            stats.refused += 1
            self.refused_ids.append(outcome.job_id)
            log.warning(
                "refused stale outcome for job %s attempt %s: lease lost, job was rescued",
                outcome.job_id,
                outcome.attempt,
            )
        for kind, count in kinds.items():
            setattr(stats, kind, getattr(stats, kind) + count)
        if not self._pending:
            self._ready.clear()
            self._drained.set()

    async def _write_isolated(self, batch: list[Outcome], progress: _Flush) -> None:
        """Write ``batch`` in one transaction; if PostgreSQL refuses it for its rows, write
        each half on its own, down to the one refused outcome (bisection: a poisoned batch
        of n costs about 2 log2(n) statements more per bad row)."""
        try:
            progress.written.update(await self._write(batch))
            progress.settled.extend(batch)
            return
        except Exception as exc:
            if not _refused_for_its_rows(exc):
                raise
            refusal: Exception = exc
        if len(batch) > 1:
            middle = len(batch) // 2
            await self._write_isolated(batch[:middle], progress)
            await self._write_isolated(batch[middle:], progress)
            return
        await self._write_refused(batch[0], refusal, progress)
        progress.settled.append(batch[0])

    async def _write(self, batch: list[Outcome]) -> set[int]:
        writes = outcome_writes(batch)
        if len(writes) == 1:
            return await self._write_alone(*writes[0])
        written: set[int] = set()
        # Pipelined: the transaction's statements go out together and their results come
        # back together, one round trip for the flush instead of one per statement.
        async with self.pool.connection() as conn, conn.pipeline():
            cursors = []
            async with conn.transaction():
                await conn.execute(self._durable_sql)
                for group, params in writes:
                    cursors.append(
                        await conn.execute(
                            self._sql[group], {**params, "worker_id": self.worker_id}
                        )
                    )
                # One wake-up per flush for anyone awaiting a result (wait_for_result).
                await conn.execute(*self._results_notice)
            for cur in cursors:
                written.update(r[0] for r in await cur.fetchall())
        return written

    async def _write_alone(self, group: str, params: dict[str, Any]) -> set[int]:
        """A batch of one group of outcomes: one statement that commits by itself, durably,
        waking result waiters (sql/complete.py, _committing_alone)."""
        params = {**params, "worker_id": self.worker_id, "channel": self._done_channel}
        async with self.pool.connection() as conn:
            if conn.autocommit:
                cur = await conn.execute(self._alone_sql[group], params)
            else:  # a pool of transactional sessions: the statement needs its commit
                async with conn.transaction():
                    cur = await conn.execute(self._alone_sql[group], params)
            return {r[0] for r in await cur.fetchall() if r[0] is not None}

    async def _write_refused(
        self, outcome: Outcome, refusal: BaseException, progress: _Flush
    ) -> None:
        """Record ``outcome``'s attempt as failed, with the reason PostgreSQL refused it."""
        error = refused_error(outcome, refusal, datetime.now(UTC).isoformat())
        log.error(
            "job %s attempt %s: its %s outcome was refused (%s); recorded as a failure",
            outcome.job_id,
            outcome.attempt,
            outcome.kind,
            error["message"],
        )
        params = {
            "id": outcome.job_id,
            "attempt": outcome.attempt,
            "worker_id": self.worker_id,
            "delay": REFUSED_BACKOFF.delay(outcome.attempt, self._rng),
            "error": Jsonb(error),
        }
        try:
            async with self.pool.connection() as conn, conn.transaction():
                await conn.execute(self._durable_sql)
                cur = await conn.execute(self._refused_sql, params)
                if await cur.fetchone() is not None:
                    progress.unstorable.add(outcome.job_id)
        except Exception as exc:
            if not _refused_for_its_rows(exc):
                raise
            # Not even a plain failure was taken: leave the job to its lease (it runs again).
            progress.dropped.add(outcome.job_id)
            log.exception("could not record the failure of job %s either", outcome.job_id)
