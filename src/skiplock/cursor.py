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
