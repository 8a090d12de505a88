"""Cron schedules: parsing and next fire times. Pure: no clock, no I/O.

Five fields, minute hour day-of-month month day-of-week, each ``*``, a number, a range
``a-b``, a step ``*/n`` or ``a-b/n``, or a comma list of those; months and weekdays also
by three-letter name. As in Vixie cron, when both day fields are restricted a day matches
if either does. ``@hourly``, ``@daily``, ``@weekly``, ``@monthly`` and ``@yearly`` are
shorthands. Times are computed in the schedule's timezone (UTC unless given).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from skiplock.errors import ConfigurationError

_SHORTHANDS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}
_MONTHS = {
    m: i
    for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], 1
    )
}
_DAYS = {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
# (name, low, high, names)
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
# How far ahead to look before concluding a schedule never fires (e.g. 30 February). Nine
# years: after 29 February 2096 the next is in 2104 (2100 is not a leap year).
_HORIZON_DAYS = 366 * 9
_MINUTE = timedelta(minutes=1)
_HOUR = timedelta(hours=1)
# Longer than any clock change back (two hours, in Antarctica/Troll and in history).
_LONGEST_REPEAT = timedelta(hours=3)


def _value(text: str, name: str, low: int, high: int, names: dict[str, int]) -> int:
    key = text.lower()
    if key in names:
        return names[key]
    if not text.isdigit():
        raise ValueError(
            f"{name}: {text!r} is not a number"
            + (f" or a name ({', '.join(names)})" if names else "")
        )
    number = int(text)
    if not low <= number <= high:
        raise ValueError(f"{name}: {number} is outside {low}-{high}")
    return number


def _parse_field(
    text: str, name: str, low: int, high: int, names: dict[str, int]
) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        if not part:
            raise ValueError(f"{name}: empty item in {text!r}")
        base, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise ValueError(f"{name}: step {step_text!r} must be a positive number")
            step = int(step_text)
        if base == "*":
            start, end = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start = _value(first, name, low, high, names)
            end = _value(last, name, low, high, names)
            if start > end:
                raise ValueError(f"{name}: range {base!r} runs backwards")
        else:
            start = _value(base, name, low, high, names)
            end = high if step_text else start
        values.update(range(start, end + 1, step))
    return frozenset(values)


@dataclass(frozen=True)
class CronSchedule:
    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_restricted: bool
    weekdays_restricted: bool
    tz: tzinfo
    # "*" hours: the second pass through a repeated local hour (DST ending) fires too.
    hours_every: bool = False

    def _day_matches(self, day: datetime) -> bool:
        weekday = (day.weekday() + 1) % 7  # Python: Monday = 0; cron: Sunday = 0
        in_days = day.day in self.days
        in_weekdays = weekday in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return in_days or in_weekdays
        return in_days and in_weekdays

    def next_after(self, moment: datetime) -> datetime:
        """The first fire time strictly after ``moment`` (aware), in UTC.

        Walks local wall-clock time: a time skipped when DST starts fires an hour later
        (02:30 becomes 03:30), and a time repeated when DST ends fires once, at its first
        occurrence, unless the hour field is ``*``: then the repeated hour's minutes fire
        again, as in Vixie cron.
        """
        if moment.tzinfo is None:
            raise ValueError("next_after needs a timezone-aware datetime")
        first = self._next_local(moment)
        if self.hours_every and self.tz is not UTC:
            repeated = self._repeated_between(moment, first)
            if repeated is not None:
                return repeated
        return first

    def _repeated_between(self, moment: datetime, until: datetime) -> datetime | None:
        """The first matching minute in the second pass of a repeated local time (clocks
        going back), after ``moment`` and before ``until``; None when there is none.

        The repeated span is found where the UTC offset drops, to the minute: it need not
        start on a UTC hour (Adelaide, Newfoundland) nor last an hour (Lord Howe Island).
        """
        hour = moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        hour -= _LONGEST_REPEAT  # a span that began before ``moment`` may still run on
        while hour < until:
            before = hour.astimezone(self.tz).utcoffset()
            after = (hour + _HOUR).astimezone(self.tz).utcoffset()
            if before is not None and after is not None and after < before:
                change = hour + _MINUTE
                while change.astimezone(self.tz).utcoffset() == before:
                    change += _MINUTE
                found = self._first_in_span(change, change + (before - after), moment, until)
                if found is not None:
                    return found
            hour += _HOUR
        return None

    def _first_in_span(
        self, start: datetime, end: datetime, moment: datetime, until: datetime
    ) -> datetime | None:
        """The first minute in [start, end) on the schedule, after ``moment`` and before
        ``until``: the local times of that span are the second pass (fold 1)."""
        candidate = max(start, moment.replace(second=0, microsecond=0) + _MINUTE)
        while candidate < min(end, until):
            local = candidate.astimezone(self.tz)
            if (
                local.minute in self.minutes
                and local.hour in self.hours
                and local.month in self.months
                and self._day_matches(local)
            ):
                return candidate
            candidate += _MINUTE
        return None

    def _next_local(self, moment: datetime) -> datetime:
        local = moment.astimezone(self.tz).replace(second=0, microsecond=0, tzinfo=None)
        candidate = local + timedelta(minutes=1)
        limit = candidate + timedelta(days=_HORIZON_DAYS)
        while candidate < limit:
            if candidate.month not in self.months or not self._day_matches(candidate):
                candidate = (candidate + timedelta(days=1)).replace(hour=0, minute=0)
                continue
            if candidate.hour not in self.hours:
                candidate = (candidate + timedelta(hours=1)).replace(minute=0)
                continue
            if candidate.minute not in self.minutes:
                candidate += timedelta(minutes=1)
                continue
            aware = candidate.replace(tzinfo=self.tz)
            result = aware.astimezone(UTC)
            if result > moment:
                return result
            candidate += timedelta(minutes=1)  # a DST fold mapped it back in time
        raise ValueError(f"cron {self.expression!r} never fires")


def parse_cron(expression: str, tz: str | None = None) -> CronSchedule:
    """Parse ``expression``; a ConfigurationError says which field is wrong and why."""
    text = _SHORTHANDS.get(expression.strip().lower(), expression.strip())
    parts = text.split()
    if len(parts) != 5:
        raise ConfigurationError(
            f"cron {expression!r} must have 5 fields (minute hour day-of-month month "
            f"day-of-week) or be one of {', '.join(_SHORTHANDS)}; it has {len(parts)}"
        )
    try:
        zone: tzinfo = ZoneInfo(tz) if tz else UTC
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigurationError(f"unknown timezone {tz!r} for cron {expression!r}") from exc
    try:
        fields = [_parse_field(p, *spec) for p, spec in zip(parts, _FIELDS, strict=True)]
    except ValueError as exc:
        raise ConfigurationError(f"cron {expression!r}: {exc}") from None
    weekdays = frozenset(d % 7 for d in fields[4])  # 7 is Sunday too
    schedule = CronSchedule(
        expression=expression,
        minutes=fields[0],
        hours=fields[1],
        days=fields[2],
        months=fields[3],
        weekdays=weekdays,
        # As in Vixie cron, a day field counts as restricted unless it starts with "*".
        days_restricted=not parts[2].startswith("*"),
        weekdays_restricted=not parts[4].startswith("*"),
        tz=zone,
        hours_every=parts[1].startswith("*"),
    )
    try:
        schedule.next_after(datetime(2000, 1, 1, tzinfo=UTC))
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    return schedule


MISSED_POLICIES = ("latest", "all", "skip")
MAX_CATCH_UP = 100
SKIP_GRACE = timedelta(seconds=60)


def _recent_start(
    schedule: CronSchedule, last_tick: datetime, now: datetime, wanted: int
) -> datetime:
    """A moment at or after ``last_tick`` from which at least ``wanted`` ticks (or all of
    them) lie before ``now``: after a long outage, only the last few ticks are walked."""
    window = timedelta(hours=1)
    while now - window > last_tick:
        count, tick = 0, schedule.next_after(now - window)
        while tick <= now and count < wanted:
            count += 1
            tick = schedule.next_after(tick)
        if count >= wanted:
            return now - window
        window *= 4
    return last_tick


def due_ticks(
    schedule: CronSchedule, last_tick: datetime | None, now: datetime, policy: str
) -> tuple[list[datetime], datetime | None]:
    """Ticks to enqueue now, and the new last tick to record.

    A schedule seen for the first time starts from ``now`` (nothing fires at once). Ticks
    missed while no leader ran are handled by ``policy``: ``latest`` enqueues only the most
    recent, ``all`` every one (at most MAX_CATCH_UP), ``skip`` only a tick that fell due in
    the last SKIP_GRACE (the on-time tick), never older ones.
    """
    if last_tick is None:
        return [], now
    due: list[datetime] = []
    start = _recent_start(schedule, last_tick, now, MAX_CATCH_UP + 1)
    tick = schedule.next_after(start)
    while tick <= now:
        due.append(tick)
        if len(due) > MAX_CATCH_UP:
            due.pop(0)
        tick = schedule.next_after(tick)
    if not due:
        return [], last_tick
    newest = due[-1]
    if policy == "all":
        return due, newest
    if policy == "skip":
        return ([newest] if now - newest <= SKIP_GRACE else []), newest
    return [newest], newest
