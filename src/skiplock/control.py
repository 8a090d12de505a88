"""What arrives on skiplock's notification channels, parsed; pure, no I/O.

NOTIFY needs no privilege: any role that can connect to the database can send any payload
on any channel. So every payload is a hint from an untrusted sender. It is parsed here
into a typed message, or None when it is not something skiplock sends; a None is logged
(``Throttle`` keeps a flood to one line per channel per interval) and ignored. No message
is trusted for more than a wake-up: a cancel request is acted on only once the job's row
confirms it (sql/control.py), admission and limits are read from the tables, and a
wake-up only makes a worker claim (or look) sooner.

The payloads, as skiplock's triggers and statements write them:

- jobs channel (``<schema>.jobs``): ``queue`` or ``queue TAB priority TAB epoch-seconds``,
  the queue's lowest priority and earliest run_at among the jobs a statement made
  available (migrations/0001_jobs.sql, 0008; NOTIFY_MOVED in sql/maintenance.py;
  QUEUE_WAKE in sql/admin.py);
- control channel (``<schema>.control``): ``cancel TAB job-id`` (JOB_CANCEL_RUNNING),
  ``admit`` or ``admit TAB ordering-key`` (the key triggers of 0008), ``limits``
  (QUEUE_LIMITS_CHANGED);
- results channel (``<schema>.done``): the empty payload (JOBS_DONE_NOTIFY).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

# The column constraints (migrations/0001_jobs.sql, 0008): a payload naming more cannot
# have come from a row.
MAX_QUEUE_LENGTH = 128
MAX_KEY_LENGTH = 255
PRIORITY_RANGE = (-(2**15), 2**15 - 1)  # smallint
JOB_ID_MAX = 2**63 - 1  # bigint

# ASCII digits only: str.isdigit() and int() also accept '²' or '١٢', which no statement
# of ours writes ('²'.isdigit() is True and int('²') raises).
_PRIORITY = re.compile(r"-?[0-9]{1,5}")
# extract(epoch FROM timestamptz) as numeric (PostgreSQL 14 and later) or float8 text.
_EPOCH = re.compile(r"-?[0-9]{1,20}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?")
# The run_at of a row written by hand can be +-infinity; the wake-up then carries no
# position, only the queue (a '-infinity' job is due at once).
_EPOCH_INFINITE = frozenset({"Infinity", "-Infinity"})
_JOB_ID = re.compile(r"[1-9][0-9]{0,18}")


class Channel(StrEnum):
    """The kinds of channel; each schema has one of each (config.py names them:
    ``<schema>.jobs``, ``<schema>.control``, ``<schema>.done``)."""

    JOBS = "jobs"
    CONTROL = "control"
    RESULTS = "done"


@dataclass(frozen=True)
class Wakeup:
    """Jobs became available in ``queue``; the earliest position that changed, when the
    payload says (see cursor.ClaimCursor.rewind)."""

    queue: str
    priority: int | None = None
    run_at: datetime | None = None


@dataclass(frozen=True)
class CancelRequest:
    """Someone asks that the running job ``job_id`` stop; to be confirmed by its row."""

    job_id: int


@dataclass(frozen=True)
class AdmitRequest:
    """Waiting jobs of ``key`` may be admitted now; None: any key's (a full pass)."""

    key: str | None


@dataclass(frozen=True)
class LimitsChanged:
    """A queue's limits changed: re-read them before the next claim."""


@dataclass(frozen=True)
class ResultsReady:
    """Outcomes were written: whoever waits for a result reads it again."""


ControlMessage = CancelRequest | AdmitRequest | LimitsChanged
Message = Wakeup | ControlMessage | ResultsReady


def parse(channel: Channel, payload: str) -> Message | None:
    """The message ``payload`` carries on a channel of kind ``channel``, or None when it
    is malformed. Never raises, whatever the string."""
    if channel is Channel.JOBS:
        return parse_wakeup(payload)
    if channel is Channel.CONTROL:
        return parse_control(payload)
    return parse_results(payload)


def parse_wakeup(payload: str) -> Wakeup | None:
    """``queue`` or ``queue TAB priority TAB epoch-seconds``. A position that cannot be a
    datetime (±infinity, beyond year 9999) still wakes the queue, without a position."""
    parts = payload.rsplit("\t", 2)
    if len(parts) == 1:
        return Wakeup(payload) if _queue_name(payload) else None
    if len(parts) != 3:
        return None
    queue, priority_text, epoch = parts
    if not _queue_name(queue) or not _PRIORITY.fullmatch(priority_text):
        return None
    priority = int(priority_text)
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        return None
    if epoch in _EPOCH_INFINITE:
        return Wakeup(queue)
    if not _EPOCH.fullmatch(epoch):
        return None
    seconds = float(epoch)
    if not math.isfinite(seconds):
        return Wakeup(queue)
    try:
        run_at = datetime.fromtimestamp(seconds, UTC)
    except (ValueError, OverflowError, OSError):
        return Wakeup(queue)
    return Wakeup(queue, priority, run_at)


def parse_control(payload: str) -> ControlMessage | None:
    """``cancel TAB id``, ``admit``, ``admit TAB key`` or ``limits``."""
    verb, tab, argument = payload.partition("\t")
    if verb == "cancel" and _JOB_ID.fullmatch(argument):
        job_id = int(argument)
        return CancelRequest(job_id) if job_id <= JOB_ID_MAX else None
    if verb == "admit":
        if not tab:
            return AdmitRequest(None)
        return AdmitRequest(argument) if 1 <= len(argument) <= MAX_KEY_LENGTH else None
    if payload == "limits":
        return LimitsChanged()
    return None


def parse_results(payload: str) -> ResultsReady | None:
    """The empty payload."""
    return ResultsReady() if payload == "" else None


def _queue_name(name: str) -> bool:
    return 1 <= len(name) <= MAX_QUEUE_LENGTH


def describe_payload(payload: str, limit: int = 80) -> str:
    """The payload for a log line: quoted, escaped, at most ``limit`` characters of it."""
    if len(payload) <= limit:
        return repr(payload)
    return f"{payload[:limit]!r}... ({len(payload)} characters)"


class Throttle:
    """At most one log line per key (a channel) every ``every`` seconds; the lines held
    back meanwhile are counted and reported with the next one. Time is an input."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str, now: float) -> int | None:
        """None: hold this line back. Otherwise write it, saying how many were held back
        since the last one (the returned count)."""
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)
