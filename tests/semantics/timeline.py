"""Handler runs recorded on one monotonic clock, and the figures the semantics tests
compute from them: overlap (concurrency) and starts per window (rates)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

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


class WindowLog:
    """Every time a rate limit counted, read from the database's own sliding window (the
    admitter's key_rates, a queue's rate_window) every POLL_SECONDS while the test runs,
    and once more at its end: a time stays in its window for at least the period, so none
    is missed. What a rate limits is those times, on the database's clock; a handler
    starts a little after its job was counted, later on a busy machine, so the starts of
    two windows can come closer together than the counted times ever do (the README says
    so). ``read`` returns (key, times) rows."""

    POLL_SECONDS = 0.05

    def __init__(self, read: Callable[[], Sequence[tuple[str, Sequence[datetime]]]]) -> None:
        self._read = read
        # Per key, each time with its count (one statement counts several jobs at one
        # time): the most seen in any one read.
        self.seen: dict[str, Counter[datetime]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _take(self) -> None:
        for key, times in self._read():
            now: Counter[datetime] = Counter(times)
            self.seen[key] = self.seen.get(key, Counter()) | now

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._take()
            self._stop.wait(self.POLL_SECONDS)

    def __enter__(self) -> WindowLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._take()  # the last ones, counted since the last read

    def times(self, key: str) -> list[float]:
        return sorted(t.timestamp() for t in self.seen.get(key, Counter()).elements())
