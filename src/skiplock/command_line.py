"""Numbers on a command line: argparse types that refuse, by name and in one line, what
an option cannot use (a negative count, a zero where zero means nothing, a value past
what PostgreSQL or the system stores, NaN and infinities), before anything runs.

``skiplock``'s commands, the worker's options (worker/options.py) and so ``manage.py
skiplock_worker`` take their numeric options through these, so all refuse the same
values. Pure.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

BIGINT_MAX = 2**63 - 1  # ids, limits and counts PostgreSQL stores as bigint
INTEGER_MAX = 2**31 - 1  # what an integer column holds (a worker's concurrency)
# Seconds: a century is past any use, and well inside what sleeps, timedeltas and
# PostgreSQL's timestamps can add.
SECONDS_MAX = 100 * 365.25 * 86400
DAYS_MAX = 36_500  # a retention of a century; longer overflows dates
PROCESSES_MAX = 1_000  # each a worker with its own connections


@dataclass(frozen=True)
class Number:
    """An argparse ``type``: a number from ``minimum`` to ``maximum`` (``minimum``
    itself excluded when ``above``), finite; ``whole`` for integers. ``unit`` names what
    it counts in the message."""

    minimum: float
    maximum: float
    whole: bool = False
    above: bool = False
    unit: str = ""

    @property
    def __name__(self) -> str:  # argparse names the type in some of its messages
        return "integer" if self.whole else "number"

    def __call__(self, text: str) -> int | float:
        value: int | float | None
        try:
            value = int(text) if self.whole else float(text)
        except ValueError:
            value = None
        if value is None or not self.allows(value):
            raise argparse.ArgumentTypeError(f"must be {self.expected}, got {text!r}")
        return value

    def allows(self, value: float) -> bool:
        if not math.isfinite(value) or value > self.maximum:
            return False
        return value > self.minimum if self.above else value >= self.minimum

    @property
    def expected(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        low, high = _shown(self.minimum), _shown(self.maximum)
        if self.whole:
            return f"from {low} to {high} (a whole number{unit})"
        return f"{'>' if self.above else '>='} {low} and <= {high}{unit}"


def _shown(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def count(minimum: int, maximum: int = BIGINT_MAX, unit: str = "") -> Number:
    return Number(minimum, maximum, whole=True, unit=unit)


def seconds(*, above_zero: bool = False, maximum: float = SECONDS_MAX) -> Number:
    return Number(0, maximum, above=above_zero, unit="seconds")


JOB_ID = count(1)
PORT = count(1, 65535)
PROCESSES = count(1, PROCESSES_MAX)
CONCURRENCY = count(1, INTEGER_MAX)
RETENTION_DAYS = Number(0, DAYS_MAX, unit="days")
# tcp_user_timeout is sent in milliseconds, as a C int.
TCP_USER_TIMEOUT = seconds(maximum=INTEGER_MAX // 1000)
PREFETCH = count(0, INTEGER_MAX)


@dataclass(frozen=True)
class CommaSeparated:
    """An argparse ``type``: comma-separated numbers, each taken by ``each``; ``noun``
    names them in the message (``must be comma-separated seconds, each >= 0 ...``)."""

    each: Number
    noun: str

    def __call__(self, text: str) -> list[int | float]:
        try:
            return [self.each(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated {self.noun}, each {self.each.expected}, got {text!r}"
            ) from None


def prefetch_setting(text: str) -> int | None:
    """``--prefetch``: 'auto' (None: sized from job durations) or a count >= 0."""
    if text == "auto":
        return None
    try:
        return int(PREFETCH(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or {PREFETCH.expected}, got {text!r}"
        ) from None
