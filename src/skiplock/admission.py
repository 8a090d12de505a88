"""One admission pass over keyed jobs, in which one bad key or row stays one bad key or row.

Admission (decisions 011 and 017, sql/keys.py) is one set-based statement for the keys
asked about (ADMIT_KEYS_CHUNK at a time), so a single value the database refuses (a row
a constraint added later rejects, a unique index hand-written rows already fill) would
fail the statement for every key, on every pass, forever. So the set-based statement
is tried first; when it raises a data or integrity error, the keys are
bisected, each half in a transaction of its own, down to the keys that fail alone. A key
that fails alone is tried job by job from the head of its line (ADMIT_HEADS), and a head
that cannot be admitted even alone is the row at fault: it ends dead with the database's
reason among its errors, which frees its line (and `skiplock jobs retry` brings it back
once the cause is fixed).

When every key tried fails alone, the fault is not in a row (a bug, a constraint on
every row): then nothing is made dead, the keys are reported, and the next pass tries
again. Other errors (connection lost, lock or statement timeout) are the caller's to
retry: they say nothing about a row.

Warnings about failing keys are rate-limited per key; each job made dead is logged at
ERROR, at most ``DEAD_MAX_PER_PASS`` per pass.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from skiplock.sql import keys, render

log = logging.getLogger("skiplock.admission")

# Errors that a value of some row can cause, and that trying fewer keys can therefore
# avoid: invalid or out-of-range values, constraint and unique violations.
ROW_ERRORS = (psycopg.errors.DataError, psycopg.errors.IntegrityError)

# At most this many jobs end dead in one pass: if something other than the rows is at
# fault, the damage of one pass stays small and visible.
DEAD_MAX_PER_PASS = 10
# A key is tried head by head at most this many times in one pass; the rest of its line
# waits for the next pass.
HEADS_MAX_PER_KEY = 100
# A failing key is warned about at most once per this many seconds.
FAILURE_LOG_INTERVAL = 60.0
# A rate-limited key is visited again within this many seconds at the latest (a stored
# period may be absurd; the wait must stay one the event loop can sleep).
RATE_DUE_MAX = 3600.0
RATE_DUE_MIN = 0.001
# The failure log's entry for a pass in which every key failed (no key is empty: 0008).
EVERY_KEY = ""
# Keys admitted per transaction: it holds one lock per key until it commits, from
# PostgreSQL's shared lock table (max_locks_per_transaction per connection, on average).
ADMIT_KEYS_CHUNK = 256
# Reasons recorded among a job's errors are cut to this many characters.
REASON_MAX = 1000


@dataclass
class AdmissionReport:
    """What one pass did: jobs admitted; keys that could not be admitted (key -> the
    database's reason); jobs made dead because they alone could not be admitted; for
    rate-limited keys with jobs waiting, seconds until their window makes room; and keys
    left alone because another admitter held them (to be asked about again soon)."""

    admitted: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    dead: list[int] = field(default_factory=list)
    rate_due: dict[str, float] = field(default_factory=dict)
    busy: list[str] = field(default_factory=list)


class FailureLog:
    """Which failures to warn about now: each key at most once per ``interval`` seconds.
    Remembers at most ``size`` keys (the oldest are forgotten first)."""

    def __init__(self, interval: float = FAILURE_LOG_INTERVAL, size: int = 10_000) -> None:
        self.interval = interval
        self.size = size
        self._last: dict[str, float] = {}

    def due(self, key: str, now: float) -> bool:
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            return False
        self._last.pop(key, None)
        self._last[key] = now
        while len(self._last) > self.size:
            del self._last[next(iter(self._last))]
        return True


_failure_log = FailureLog()


def seconds_until_due(value: object) -> float:
    """A rate window's remaining seconds as the database computed them, made safe to sleep
    on: not a number or absurdly far -> RATE_DUE_MAX; passed -> RATE_DUE_MIN."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return RATE_DUE_MAX
    if not math.isfinite(seconds) or seconds > RATE_DUE_MAX:
        return RATE_DUE_MAX
    return max(seconds, RATE_DUE_MIN)


def reason_of(exc: BaseException) -> str:
    """The database's message for a failed admission, one line, bounded."""
    text = " ".join(str(exc).split())
    sqlstate = getattr(exc, "sqlstate", None)
    reason = f"{text} (SQLSTATE {sqlstate})" if sqlstate else text
    return reason[:REASON_MAX]


def rows_at_fault(tried: int, failed: int) -> bool:
    """Whether keys that failed alone point at rows: not when every one of several keys
    failed (then the cause is common to them all, not a value of one)."""
    return failed > 0 and not (tried > 1 and failed == tried)


async def admit_pass(
    conn: psycopg.AsyncConnection[Any],
    schema: str,
    asked: Sequence[str] | None,
    *,
    failure_log: FailureLog | None = None,
    stalled: bool = False,
) -> AdmissionReport:
    """Admit the keys ``asked`` (None: every key with waiting jobs; with ``stalled``, also
    every key with waiting jobs and none admitted, KEYS_STALLED), ADMIT_KEYS_CHUNK keys
    per transaction, and read when rate-limited keys have room again. Admission notifies
    the queues that received jobs (keys_admit, migration 0015).

    ``conn`` must be in autocommit mode: every attempt is a transaction of its own, under
    the keys' locks. Errors other than ROW_ERRORS are raised to the caller."""
    admitting = _Pass(conn, schema, _failure_log if failure_log is None else failure_log)
    report = admitting.report
    if asked is None:
        cur = await conn.execute(render(keys.KEYS_WAITING, schema))
        wanted = [str(row[0]) for row in await cur.fetchall()]
    else:
        wanted = sorted(set(asked))
        if stalled:
            cur = await conn.execute(render(keys.KEYS_STALLED, schema))
            wanted = sorted(set(wanted) | {str(row[0]) for row in await cur.fetchall()})
    failing: list[str] = []
    reason = ""
    for start in range(0, len(wanted), ADMIT_KEYS_CHUNK):
        chunk = wanted[start : start + ADMIT_KEYS_CHUNK]
        try:
            report.admitted += await admitting.admit(chunk)
        except ROW_ERRORS as exc:
            failing.extend(chunk)
            reason = reason or reason_of(exc)
    if failing:
        await admitting.isolate(failing, len(wanted), reason)
    if wanted or asked is not None:  # (a full pass that found nothing waiting: none due)
        report.rate_due = await _rate_due(conn, schema)
    return report


@dataclass
class _Pass:
    """What every step of one pass works on: the connection, the schema and the report
    it fills."""

    conn: psycopg.AsyncConnection[Any]
    schema: str
    failures: FailureLog
    report: AdmissionReport = field(default_factory=AdmissionReport)

    async def admit(self, asked: Sequence[str], *, heads: bool = False) -> int:
        """One admission of at most ADMIT_KEYS_CHUNK keys: one statement, one transaction.
        Returns the jobs admitted; keys another admitter held go to ``report.busy``."""
        statement = keys.ADMIT_HEADS if heads else keys.ADMIT
        cur = await self.conn.execute(render(statement, self.schema), {"keys": list(asked)})
        admitted = 0
        for _queue, jobs, busy in await cur.fetchall():
            admitted += int(jobs)
            if busy is not None:
                self.report.busy.append(str(busy))
        return admitted

    async def isolate(self, failing: list[str], tried: int, reason: str) -> None:
        """The set-based statement failed for the keys ``failing`` (with ``reason``), out of
        ``tried`` keys asked about: admit what can be admitted, half by half, and find the
        keys (then the rows) that cannot."""
        report = self.report
        failed: dict[str, str] = {}

        async def bisect(group: list[str], why: str) -> None:
            """``group`` failed as a whole (``why``): try each half."""
            if len(group) == 1:
                failed[group[0]] = why
                return
            middle = len(group) // 2
            for half in (group[:middle], group[middle:]):
                try:
                    report.admitted += await self.admit(half)
                except ROW_ERRORS as exc:
                    await bisect(half, reason_of(exc))

        await bisect(failing, reason)
        now = time.monotonic()
        if not rows_at_fault(tried, len(failed)):
            report.failed.update(failed)
            if failed and self.failures.due(EVERY_KEY, now):
                log.warning(
                    "admission failed for every one of %d keys; no job is made dead, since "
                    "the cause is not one row (first: %s); will retry",
                    len(failed),
                    next(iter(failed.values())),
                )
            return
        report.failed.update(failed)
        for key, why in failed.items():
            await self.admit_heads(key)
            if self.failures.due(key, now):
                log.warning("admitting key %r failed: %s", key, why)

    async def admit_heads(self, key: str) -> None:
        """Admit the key's line head by head; a head that cannot be admitted alone ends dead
        with the reason, and the next one is tried. Stops when a head does not fit (or none
        waits), or at this pass's bounds."""
        conn, schema, report = self.conn, self.schema, self.report
        for _ in range(HEADS_MAX_PER_KEY):
            if len(report.dead) >= DEAD_MAX_PER_PASS:
                return
            async with conn.transaction():
                await conn.execute(render(keys.KEYS_LOCK, schema), {"keys": [key]})
                head = await _head(conn, schema, key)
                if head is None:
                    return
                try:
                    async with conn.transaction():  # a savepoint: the lock stays held
                        admitted = await self.admit([key], heads=True)
                except ROW_ERRORS as exc:
                    if not await _make_dead(conn, schema, key, head, reason_of(exc)):
                        return
                    report.dead.append(head)
                    continue
            if admitted == 0:
                return
            report.admitted += admitted


async def _make_dead(
    conn: psycopg.AsyncConnection[Any], schema: str, key: str, head: int, reason: str
) -> bool:
    """The head could not be admitted alone: it ends dead, with the reason. Only the job
    that was tried: still the head after the failure (a dead job retried by hand joins a
    line as its oldest). False when it could not be made dead (then its key waits)."""
    if await _head(conn, schema, key) != head:
        return False
    try:
        async with conn.transaction():
            cur = await conn.execute(
                render(keys.JOB_DEAD_IF_WAITING, schema),
                {"id": head, "reason": f"could not be admitted: {reason}"},
            )
            if await cur.fetchone() is None:
                return False
    except ROW_ERRORS as exc:
        # The row refuses any change (a constraint that also rejects it dead): its key
        # stays stuck and is reported; the other keys go on.
        log.error("keyed job %d could not be made dead either: %s", head, reason_of(exc))
        return False
    log.error("keyed job %d (key %r) could not be admitted and is now dead: %s", head, key, reason)
    return True


async def _head(conn: psycopg.AsyncConnection[Any], schema: str, key: str) -> int | None:
    cur = await conn.execute(render(keys.KEY_WAITING_HEAD, schema), {"key": key})
    row = await cur.fetchone()
    return None if row is None else int(row[0])


async def _rate_due(conn: psycopg.AsyncConnection[Any], schema: str) -> dict[str, float]:
    try:
        cur = await conn.execute(render(keys.KEY_RATE_NEXT, schema))
        rows = await cur.fetchall()
    except ROW_ERRORS as exc:
        # The full pass comes back for them anyway; only the early visit is lost.
        log.warning("reading when rate-limited keys have room failed: %s", reason_of(exc))
        return {}
    return {str(key): seconds_until_due(seconds) for key, seconds in rows}
