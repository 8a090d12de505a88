"""Handler runs recorded on one monotonic clock, and the figures the semantics tests
compute from them: overlap (concurrency) and starts per window (rates)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import skiplock


@dataclass(frozen=True)
class Run:
    """One attempt of one job, as its handler saw it."""

    key: str
    n: int
    attempt: int
    start: float
    end: float

    def overlaps(self, other: Run) -> bool:
        return self.start < other.end and other.start < self.end


class Timeline:
    """Handler runs, recorded from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: list[Run] = []

    @contextlib.contextmanager
    def run(self, key: str, n: int) -> Iterator[int]:
        """Record the handler's run (also when it raises); yields the attempt number."""
        attempt = skiplock.current_job().attempts
        start = time.monotonic()
        try:
            yield attempt
        finally:
            end = time.monotonic()
            with self._lock:
                self._runs.append(Run(key, n, attempt, start, end))

    def runs(self, key: str | None = None) -> list[Run]:
        """Runs (of ``key``, or all), in the order they started."""
        with self._lock:
            found = [r for r in self._runs if key is None or r.key == key]
        return sorted(found, key=lambda r: r.start)


def max_overlap(runs: Sequence[Run]) -> int:
    """The most runs in progress at one time. At equal times an end counts before a
    start: a run that starts as another ends does not overlap it."""
    events = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs])
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def most_starts_within(starts: Sequence[float], window: float) -> int:
    """The most starts in any half-open interval [t, t + window)."""
    ordered = sorted(starts)
    most = 0
    first = 0
    for last, at in enumerate(ordered):
        while at - ordered[first] >= window:
            first += 1
        most = max(most, last - first + 1)
    return most
