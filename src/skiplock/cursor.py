"""Where a queue's next claim starts: pure bookkeeping, no I/O.

Claims read the jobs_claim index in (priority, run_at, id) order. Each claim moves the
cursor to the last job it took; the next claim starts after it. Jobs can still become
available behind the cursor (a higher priority, a transaction that committed late, a
rescue or promotion of an older job): their notification carries the queue's lowest
(priority, run_at) and rewinds the cursor. Whatever no notification announced is found
off the claim path: every ``probe_interval`` seconds the worker looks for the first ready
job behind the cursor (JOB_BEHIND_CURSOR) and rewinds to it. A claim never walks from the
start of the queue except after the listener reconnects (``force_sweep``): while VACUUM
is held back, that walk reads every entry consumed since, and a claim that did it on a
timer made the batch that drew the short straw wait. Notifications are parsed, and
malformed ones dropped, in control.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from skiplock.control import Wakeup

__all__ = ["ClaimCursor", "Position", "Wakeup"]

Position = tuple[int, datetime, int]


class ClaimCursor:
    """The resume position of one queue's claims in one worker process."""

    def __init__(self) -> None:
        self.position: Position | None = None
        self._sweep = True
        # The lowest position rewound to since the claim in flight started: that claim's
        # snapshot may not hold the job announced, so its advance must not pass it.
        self._rewound: Position | None = None
        self.sweeps = 0

    def start(self) -> Position | None:
        """The position to claim after, or None for a full claim from the start."""
        self._rewound = None
        if self.position is None or self._sweep:
            self._sweep = False
            self.sweeps += 1
            return None
        return self.position

    def advance(self, claimed: list[Position]) -> None:
        """Move past the jobs just claimed, never past a position a notification asked
        for meanwhile (never backwards: that is rewind's job)."""
        rewound, self._rewound = self._rewound, None
        if not claimed:
            return
        last = max(claimed)
        if rewound is not None:
            last = min(last, rewound)
        if self.position is None or last > self.position:
            self.position = last

    def rewind(self, wakeup: Wakeup) -> None:
        """Step back to just before a position that a notification says changed."""
        if self.position is None:
            return
        if wakeup.priority is None or wakeup.run_at is None:
            self.force_sweep()
            return
        # Epoch seconds lose sub-microsecond precision: step back one microsecond more.
        self._step_back((wakeup.priority, wakeup.run_at - timedelta(microseconds=1), 0))

    def rewind_to(self, found: Position) -> None:
        """Step back to just before a ready job that the probe found behind the cursor."""
        if self.position is None:
            return
        priority, run_at, job_id = found
        self._step_back((priority, run_at, job_id - 1))

    def _step_back(self, target: Position) -> None:
        self.position = min(self.position, target) if self.position is not None else target
        self._rewound = target if self._rewound is None else min(self._rewound, target)

    def force_sweep(self) -> None:
        self._sweep = True


LATE_READ_LIMIT = 1000


class LateReads:
    """Where each queue's probe for late commits resumes (sql/wakeup.py, JOB_LATE_COMMITS):
    pure bookkeeping, no I/O.

    A busy worker hears no notification (decision 023), so jobs that commit behind its
    cursor are found by reading the jobs of every transaction that had not ended at the
    previous read's snapshot: those still in progress then (``pending``, resumed per
    transaction after the last job read) and those that began after (``recent``, from its
    xmax on). A read cut short at ``limit`` jobs resumes where it stopped.
    """

    def __init__(self, limit: int = LATE_READ_LIMIT) -> None:
        self.limit = limit
        # Per queue: the (xid, id) after which recent jobs are read, and the transactions
        # still pending with the id after which their jobs are read. xids stay text: only
        # the database compares them.
        self._recent: dict[str, tuple[str, int]] = {}
        self._pending: dict[str, dict[str, int]] = {}
        self.cut_short = False

    def params(self, queues: list[str], excluded: list[str]) -> dict[str, object]:
        """Arguments for the next read of ``queues`` (those never read start from its
        snapshot: nothing is asked of them this time)."""
        known = [q for q in queues if q in self._recent]
        pending = [(q, xid, after) for q in known for xid, after in self._pending[q].items()]
        return {
            "queues": known,
            "xmax": [self._recent[q][0] for q in known],
            "after_id": [self._recent[q][1] for q in known],
            "p_queues": [p[0] for p in pending],
            "p_xids": [p[1] for p in pending],
            "p_after_id": [p[2] for p in pending],
            "exclude_tasks": excluded,
            "limit": self.limit,
        }

    def read(self, queues: list[str], rows: list[tuple[object, ...]]) -> dict[str, Position]:
        """Take a read's answer; the first ready job found per queue."""
        xmax = next(str(r[2]) for r in rows if r[0] == "snapshot")
        xip = [str(r[2]) for r in rows if r[0] == "xip"]
        found: dict[str, Position] = {}
        recent_cut: dict[str, tuple[str, int]] = {}
        pending_cut: dict[str, dict[str, int]] = {}
        for part, queue, xid, count, last_id, priority, run_at, job_id in rows:
            if part not in ("recent", "pending"):
                continue
            assert isinstance(queue, str) and isinstance(xid, str)
            assert isinstance(count, int) and isinstance(last_id, int)
            if job_id is not None:
                assert isinstance(priority, int) and isinstance(run_at, datetime)
                assert isinstance(job_id, int)
                position = (priority, run_at, job_id)
                found[queue] = min(found.get(queue, position), position)
            if count >= self.limit:
                if part == "recent":
                    recent_cut[queue] = (xid, last_id)
                else:
                    pending_cut.setdefault(queue, {})[xid] = last_id
        self.cut_short = bool(recent_cut or pending_cut)
        for queue in queues:
            if queue in recent_cut:
                # Cut short: resume there, and keep waiting on everything pending before.
                self._recent[queue] = recent_cut[queue]
                pending = self._pending.setdefault(queue, {})
                pending.update({x: 0 for x in xip if x not in pending})
                pending.update(pending_cut.get(queue, {}))
                continue
            self._recent[queue] = (xmax, 0)
            self._pending[queue] = {x: 0 for x in xip} | pending_cut.get(queue, {})
        return found
