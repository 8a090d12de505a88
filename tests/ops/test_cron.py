"""Cron schedules: parsing, next fire times, missed-tick policies. Pure: no database.

The properties check ``next_after`` against an oracle written here from the field sets
(not from ``CronSchedule``): the next fire time is after the moment, on the schedule, and
no minute on the schedule lies strictly between the two (by brute force over minutes).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skiplock import ConfigurationError, SkiplockError
from skiplock.cron import MAX_CATCH_UP, SKIP_GRACE, CronSchedule, due_ticks, parse_cron

BERLIN = "Europe/Berlin"


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


def fires(expression: str, start: datetime, count: int, tz: str | None = None) -> list[datetime]:
    schedule = parse_cron(expression, tz)
    found = []
    moment = start
    for _ in range(count):
        moment = schedule.next_after(moment)
        found.append(moment)
    return found


# -- parsing ---------------------------------------------------------------------------


def test_a_star_is_every_value_of_its_field() -> None:
    schedule = parse_cron("* * * * *")

    assert schedule.minutes == frozenset(range(60))
    assert schedule.hours == frozenset(range(24))
    assert schedule.days == frozenset(range(1, 32))
    assert schedule.months == frozenset(range(1, 13))
    assert schedule.weekdays == frozenset(range(7))
    assert not schedule.days_restricted
    assert not schedule.weekdays_restricted
    assert schedule.tz is UTC


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("5", {5}),
        ("1-4", {1, 2, 3, 4}),
        ("*/15", {0, 15, 30, 45}),
        ("10-30/10", {10, 20, 30}),
        ("50/4", {50, 54, 58}),  # a single start with a step runs to the end of the field
        ("1,2,10-12", {1, 2, 10, 11, 12}),
        ("0-5/2,30", {0, 2, 4, 30}),
        ("59", {59}),
    ],
)
def test_minute_field_forms(field: str, expected: set[int]) -> None:
    assert parse_cron(f"{field} * * * *").minutes == frozenset(expected)


def test_months_and_weekdays_by_name_in_any_case() -> None:
    schedule = parse_cron("0 9 * JAN-mar,Dec Mon-FRI")

    assert schedule.months == frozenset({1, 2, 3, 12})
    assert schedule.weekdays == frozenset({1, 2, 3, 4, 5})


@pytest.mark.parametrize("sunday", ["0", "7", "sun", "SUN"])
def test_sunday_is_0_or_7(sunday: str) -> None:
    assert parse_cron(f"0 0 * * {sunday}").weekdays == frozenset({0})


def test_a_weekday_range_may_end_on_7() -> None:
    assert parse_cron("0 0 * * 5-7").weekdays == frozenset({5, 6, 0})


@pytest.mark.parametrize(
    ("shorthand", "expanded"),
    [
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        (" @DAILY ", "0 0 * * *"),
    ],
)
def test_shorthands(shorthand: str, expanded: str) -> None:
    got, want = parse_cron(shorthand), parse_cron(expanded)

    assert (got.minutes, got.hours, got.days, got.months, got.weekdays) == (
        want.minutes,
        want.hours,
        want.days,
        want.months,
        want.weekdays,
    )
    assert got.expression == shorthand  # errors and logs show what the user wrote


def test_a_timezone_is_kept() -> None:
    assert parse_cron("0 9 * * *", BERLIN).tz == ZoneInfo(BERLIN)


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "tz", "words"),
    [
        ("* * * *", None, ["must have 5 fields", "it has 4"]),
        ("* * * * * *", None, ["must have 5 fields", "it has 6"]),
        ("", None, ["must have 5 fields", "it has 0"]),
        ("@reboot", None, ["must have 5 fields", "@hourly"]),
        ("60 * * * *", None, ["minute: 60 is outside 0-59"]),
        ("* 24 * * *", None, ["hour: 24 is outside 0-23"]),
        ("* * 0 * *", None, ["day of month: 0 is outside 1-31"]),
        ("* * 32 * *", None, ["day of month: 32 is outside 1-31"]),
        ("* * * 13 *", None, ["month: 13 is outside 1-12"]),
        ("* * * * 8", None, ["day of week: 8 is outside 0-7"]),
        ("*/0 * * * *", None, ["minute: step '0' must be a positive number"]),
        ("*/x * * * *", None, ["minute: step 'x' must be a positive number"]),
        ("5-1 * * * *", None, ["minute: range '5-1' runs backwards"]),
        ("0 0 * * fri-mon", None, ["day of week: range 'fri-mon' runs backwards"]),
        ("1,,2 * * * *", None, ["minute: empty item"]),
        ("jan * * * *", None, ["minute: 'jan' is not a number"]),
        ("0 0 * foo *", None, ["month: 'foo' is not a number or a name", "jan"]),
        ("0 0 30 2 *", None, ["never fires"]),
        ("0 0 31 4,6,9,11 *", None, ["never fires"]),
        ("0 0 * * *", "Mars/Olympus_Mons", ["unknown timezone 'Mars/Olympus_Mons'"]),
        ("0 0 * * *", "../etc/passwd", ["unknown timezone"]),
    ],
)
def test_bad_expressions_fail_with_a_message_naming_the_problem(
    expression: str, tz: str | None, words: list[str]
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_cron(expression, tz)

    message = str(caught.value)
    for word in words:
        assert word in message
    assert isinstance(caught.value, SkiplockError)


def test_30_february_fires_when_a_weekday_is_also_given() -> None:
    # Both day fields restricted: either matches (Vixie), so Mondays in February fire.
    assert fires("0 0 30 2 mon", utc(2026, 1, 1), 1) == [utc(2026, 2, 2)]


def test_next_after_needs_an_aware_moment() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        parse_cron("* * * * *").next_after(datetime(2026, 1, 1))


# -- next fire times -------------------------------------------------------------------


def test_next_after_is_strictly_after_a_fire_time() -> None:
    assert fires("*/5 * * * *", utc(2026, 5, 1, 12, 5), 2) == [
        utc(2026, 5, 1, 12, 10),
        utc(2026, 5, 1, 12, 15),
    ]


def test_seconds_are_ignored_but_the_moment_is_not_returned() -> None:
    assert fires("* * * * *", utc(2026, 5, 1, 12, 5, 59, 999999), 1) == [utc(2026, 5, 1, 12, 6)]


def test_the_result_is_in_utc_whatever_the_moment_s_zone() -> None:
    moment = datetime(2026, 5, 1, 14, 0, tzinfo=ZoneInfo(BERLIN))  # 12:00 UTC

    (result,) = fires("30 * * * *", moment, 1)

    assert result == utc(2026, 5, 1, 12, 30)
    assert result.tzinfo is UTC


def test_month_ends() -> None:
    # The 31st skips the months that have none.
    assert fires("0 0 31 * *", utc(2026, 3, 31, 12), 3) == [
        utc(2026, 5, 31),
        utc(2026, 7, 31),
        utc(2026, 8, 31),
    ]
    # The last minute of the year rolls into the next one.
    assert fires("59 23 31 12 *", utc(2026, 12, 31, 23, 59), 1) == [utc(2027, 12, 31, 23, 59)]
    assert fires("0 0 1 * *", utc(2026, 12, 31, 23, 59, 30), 1) == [utc(2027, 1, 1)]


def test_leap_days() -> None:
    assert fires("0 12 29 2 *", utc(2026, 1, 1), 3) == [
        utc(2028, 2, 29, 12),
        utc(2032, 2, 29, 12),
        utc(2036, 2, 29, 12),
    ]


def test_29_february_across_a_century_that_is_not_a_leap_year() -> None:
    assert fires("0 0 29 2 *", utc(2096, 3, 1), 1) == [utc(2104, 2, 29)]


def test_day_of_month_or_day_of_week_when_both_are_restricted() -> None:
    # 1 April 2026 is a Wednesday; the Mondays follow.
    assert fires("0 0 1 * mon", utc(2026, 3, 30, 12), 4) == [
        utc(2026, 4, 1),
        utc(2026, 4, 6),
        utc(2026, 4, 13),
        utc(2026, 4, 20),
    ]


def test_day_of_month_alone_or_day_of_week_alone() -> None:
    assert fires("0 0 1 * *", utc(2026, 3, 30, 12), 2) == [utc(2026, 4, 1), utc(2026, 5, 1)]
    assert fires("0 0 * * mon", utc(2026, 3, 30, 12), 2) == [utc(2026, 4, 6), utc(2026, 4, 13)]


def test_a_full_day_of_month_range_with_a_weekday_fires_every_day() -> None:
    # Vixie's rule applies to the text, not the set: "1-31" restricts, so OR applies.
    assert fires("0 0 1-31 * mon", utc(2026, 4, 1, 12), 3) == [
        utc(2026, 4, 2),
        utc(2026, 4, 3),
        utc(2026, 4, 4),
    ]


def test_months_and_weekdays_together() -> None:
    # Weekdays in January only: from 30 December 2026 (a Wednesday).
    assert fires("0 9 * jan mon-fri", utc(2026, 12, 30), 3) == [
        utc(2027, 1, 1, 9),
        utc(2027, 1, 4, 9),
        utc(2027, 1, 5, 9),
    ]


# -- daylight saving time (Europe/Berlin: +01:00 in winter, +02:00 in summer) ----------


def test_spring_forward_a_time_in_the_skipped_hour_fires_once_just_after_the_jump() -> None:
    # On 29 March 2026 local time jumps from 02:00 to 03:00 (01:00 UTC); 02:30 does not
    # exist, and the job runs at 03:30 local instead, as Vixie cron does.
    assert fires("30 2 * * *", utc(2026, 3, 28, 12), 3, BERLIN) == [
        utc(2026, 3, 29, 1, 30),
        utc(2026, 3, 30, 0, 30),
        utc(2026, 3, 31, 0, 30),
    ]


def test_spring_forward_hourly_keeps_firing_every_real_hour() -> None:
    assert fires("0 * * * *", utc(2026, 3, 28, 23, 30), 4, BERLIN) == [
        utc(2026, 3, 29, 0),
        utc(2026, 3, 29, 1),
        utc(2026, 3, 29, 2),
        utc(2026, 3, 29, 3),
    ]


def test_fall_back_a_time_in_the_repeated_hour_fires_once() -> None:
    # On 25 October 2026 local time goes back from 03:00 to 02:00 (at 01:00 UTC), so
    # 02:30 happens twice; a daily job runs at the first of them only.
    assert fires("30 2 * * *", utc(2026, 10, 24, 12), 3, BERLIN) == [
        utc(2026, 10, 25, 0, 30),
        utc(2026, 10, 26, 1, 30),
        utc(2026, 10, 27, 1, 30),
    ]


def test_fall_back_hourly_keeps_firing_every_real_hour() -> None:
    assert fires("0 * * * *", utc(2026, 10, 24, 23, 30), 3, BERLIN) == [
        utc(2026, 10, 25, 0),  # 02:00 summer time
        utc(2026, 10, 25, 1),  # 02:00 winter time, the repeated hour
        utc(2026, 10, 25, 2),  # 03:00 winter time
    ]


def test_fall_back_hourly_where_the_repeated_hour_starts_at_half_past_in_utc() -> None:
    # Adelaide and Newfoundland keep half-hour offsets. Newfoundland (-02:30 in summer,
    # -03:30 in winter): on 2 November 2025 local time goes back from 02:00 to 01:00 at
    # 04:30 UTC, so 01:00 happens twice, half an hour off the UTC hour.
    assert fires("0 * * * *", utc(2025, 11, 2, 2), 4, "America/St_Johns") == [
        utc(2025, 11, 2, 2, 30),  # 00:00 summer time
        utc(2025, 11, 2, 3, 30),  # 01:00 summer time
        utc(2025, 11, 2, 4, 30),  # 01:00 winter time, the repeated hour
        utc(2025, 11, 2, 5, 30),  # 02:00 winter time
    ]


def test_fall_back_by_half_an_hour_repeats_the_half_hour() -> None:
    # Lord Howe Island (+11:00 in summer, +10:30 in winter): on 6 April 2025 local time goes
    # back from 02:00 to 01:30 at 15:00 UTC; 01:30 to 01:59 happen twice.
    assert fires("30 * * * *", utc(2025, 4, 5, 14), 3, "Australia/Lord_Howe") == [
        utc(2025, 4, 5, 14, 30),  # 01:30 summer time
        utc(2025, 4, 5, 15, 0),  # 01:30 winter time, the repeated half hour
        utc(2025, 4, 5, 16, 0),  # 02:30 winter time
    ]


def test_a_weekly_schedule_keeps_its_local_time_across_the_change() -> None:
    # Mondays 09:00 Berlin: 07:00 UTC in summer, 08:00 UTC in winter.
    assert fires("0 9 * * mon", utc(2026, 10, 19), 2, BERLIN) == [
        utc(2026, 10, 19, 7),
        utc(2026, 10, 26, 8),
    ]


# -- properties ------------------------------------------------------------------------


@dataclass(frozen=True)
class Fields:
    """A schedule as the sets it stands for, with the oracle of which minutes it fires."""

    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int] | None  # None: "*"
    weekdays: frozenset[int] | None  # 0-6, Sunday 0; None: "*"

    def fires_at(self, local: datetime) -> bool:
        if local.minute not in self.minutes or local.hour not in self.hours:
            return False
        in_days = self.days is None or local.day in self.days
        in_weekdays = self.weekdays is None or local.isoweekday() % 7 in self.weekdays
        if self.days is not None and self.weekdays is not None:
            return in_days or in_weekdays
        return in_days and in_weekdays


def _listed(values: set[int]) -> str:
    return ",".join(str(v) for v in sorted(values))


@st.composite
def short_schedules(draw: st.DrawFn) -> Fields:
    """Schedules that fire at least every 31 days, so brute force over minutes is cheap."""
    step = draw(st.none() | st.integers(1, 30))
    if step is None:
        minute_set = draw(st.sets(st.integers(0, 59), min_size=1, max_size=5))
        minute_text = _listed(minute_set)
    else:
        minute_set, minute_text = set(range(0, 60, step)), f"*/{step}"
    hours = draw(st.none() | st.sets(st.integers(0, 23), min_size=1, max_size=4))
    days = draw(st.none() | st.sets(st.integers(1, 28), min_size=1, max_size=3))
    weekdays = draw(st.none() | st.sets(st.integers(0, 7), min_size=1, max_size=3))
    expression = " ".join(
        [
            minute_text,
            "*" if hours is None else _listed(hours),
            "*" if days is None else _listed(days),
            "*",
            "*" if weekdays is None else _listed(weekdays),
        ]
    )
    return Fields(
        expression=expression,
        minutes=frozenset(minute_set),
        hours=frozenset(range(24)) if hours is None else frozenset(hours),
        days=None if days is None else frozenset(days),
        weekdays=None if weekdays is None else frozenset(d % 7 for d in weekdays),
    )


# Zones without daylight saving time in these years, one with a half-hour offset and
# one with a 45-minute offset.
STEADY_ZONES = ["UTC", "Asia/Kolkata", "Asia/Kathmandu"]
moments = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2099, 12, 1), timezones=st.just(UTC)
)


@settings(max_examples=60, deadline=None)
@given(fields=short_schedules(), tz=st.sampled_from(STEADY_ZONES), moment=moments)
def test_next_after_is_the_first_fire_time_after_the_moment(
    fields: Fields, tz: str, moment: datetime
) -> None:
    schedule = parse_cron(fields.expression, tz)
    zone = ZoneInfo(tz)

    found = schedule.next_after(moment)

    assert found > moment
    assert (found.second, found.microsecond) == (0, 0)
    assert fields.fires_at(found.astimezone(zone))
    minute = moment.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while minute < found:
        assert not fields.fires_at(minute.astimezone(zone)), minute
        minute += timedelta(minutes=1)


# Zones whose clocks go back by an hour on the UTC hour, half an hour off it, by half an
# hour, at local midnight, or in the southern hemisphere.
DST_ZONES = [
    "Europe/Berlin",
    "America/New_York",
    "America/St_Johns",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "America/Havana",
    "America/Santiago",
    "Australia/Adelaide",
]


def _clocks_going_back(zone: ZoneInfo, year: int) -> list[datetime]:
    """The UTC hours in ``year`` during which ``zone``'s clocks go back."""
    hour, end, found = utc(year, 1, 1), utc(year + 1, 1, 1), []
    while hour < end:
        before = hour.astimezone(zone).utcoffset()
        after = (hour + timedelta(hours=1)).astimezone(zone).utcoffset()
        if before is not None and after is not None and after < before:
            found.append(hour)
        hour += timedelta(hours=1)
    return found


CLOCKS_GO_BACK = {
    name: [c for year in (2025, 2026) for c in _clocks_going_back(ZoneInfo(name), year)]
    for name in DST_ZONES
}


@st.composite
def moments_near_clocks_going_back(draw: st.DrawFn) -> tuple[str, datetime]:
    name = draw(st.sampled_from(DST_ZONES))
    change = draw(st.sampled_from(CLOCKS_GO_BACK[name]))
    offset = draw(st.integers(-4 * 3600, 4 * 3600))
    return name, change + timedelta(seconds=offset)


@settings(max_examples=300, deadline=None)
@given(
    minutes=st.sets(st.integers(0, 59), min_size=1, max_size=4),
    where=moments_near_clocks_going_back(),
)
def test_with_every_hour_each_real_minute_on_the_schedule_fires_when_clocks_go_back(
    minutes: set[int], where: tuple[str, datetime]
) -> None:
    """With ``*`` hours every real minute whose local time is on the schedule fires,
    the repeated hour (or half hour) when clocks go back too: the oracle walks real
    minutes, reading the local time of each."""
    name, moment = where
    zone = ZoneInfo(name)

    found = parse_cron(f"{_listed(minutes)} * * * *", name).next_after(moment)

    minute = moment.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while minute.astimezone(zone).minute not in minutes:
        minute += timedelta(minutes=1)
    assert found == minute, (name, moment, found.astimezone(zone), minute.astimezone(zone))


@settings(max_examples=60, deadline=None)
@given(
    step=st.integers(1, 90),
    start=moments,
    gap=st.integers(0, 600),
    policy=st.sampled_from(["latest", "all", "skip"]),
)
def test_due_ticks_are_the_fire_times_in_the_window(
    step: int, start: datetime, gap: int, policy: str
) -> None:
    schedule = parse_cron(f"*/{step} * * * *" if step < 60 else f"0 */{step // 60} * * *")
    now = start + timedelta(minutes=gap, seconds=17)
    in_window = []
    tick = schedule.next_after(start)
    while tick <= now:
        in_window.append(tick)
        tick = schedule.next_after(tick)

    ticks, recorded = due_ticks(schedule, start, now, policy)

    if not in_window:
        assert (ticks, recorded) == ([], start)
        return
    assert recorded == in_window[-1]
    if policy == "all":
        assert ticks == in_window[-MAX_CATCH_UP:]
    elif policy == "latest":
        assert ticks == [in_window[-1]]
    else:
        assert ticks == ([in_window[-1]] if now - in_window[-1] <= SKIP_GRACE else [])


# -- missed ticks ----------------------------------------------------------------------

EVERY_5 = parse_cron("*/5 * * * *")
LAST = utc(2026, 5, 1, 12, 0, 30)  # recorded when the schedule was first seen
MISSED = [utc(2026, 5, 1, 12, m) for m in (5, 10, 15, 20, 25, 30)]


def test_first_sight_starts_counting_from_now_and_fires_nothing() -> None:
    now = utc(2026, 5, 1, 12, 0, 30)

    assert due_ticks(EVERY_5, None, now, "all") == ([], now)


def test_nothing_due_keeps_the_last_tick() -> None:
    assert due_ticks(EVERY_5, LAST, utc(2026, 5, 1, 12, 4, 59), "all") == ([], LAST)


def test_a_tick_due_exactly_now_is_due() -> None:
    now = utc(2026, 5, 1, 12, 5)

    assert due_ticks(EVERY_5, LAST, now, "latest") == ([now], now)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("latest", MISSED[-1:]), ("all", MISSED), ("skip", MISSED[-1:])],
)
def test_missed_ticks_with_the_newest_one_on_time(policy: str, expected: list[datetime]) -> None:
    now = utc(2026, 5, 1, 12, 30, 40)

    assert due_ticks(EVERY_5, LAST, now, policy) == (expected, MISSED[-1])


@pytest.mark.parametrize(
    ("policy", "expected"), [("latest", MISSED[-1:]), ("all", MISSED), ("skip", [])]
)
def test_missed_ticks_when_even_the_newest_is_late(policy: str, expected: list[datetime]) -> None:
    now = utc(2026, 5, 1, 12, 34, 59)

    ticks, recorded = due_ticks(EVERY_5, LAST, now, policy)

    assert ticks == expected
    assert recorded == MISSED[-1]  # skipped ticks are never offered again


def test_skip_grace_is_inclusive() -> None:
    newest = MISSED[-1]

    just_late = newest + SKIP_GRACE + timedelta(microseconds=1)

    assert due_ticks(EVERY_5, LAST, newest + SKIP_GRACE, "skip")[0] == [newest]
    assert due_ticks(EVERY_5, LAST, just_late, "skip")[0] == []


def test_all_catches_up_at_most_the_newest_hundred() -> None:
    every_minute = parse_cron("* * * * *")
    last = utc(2026, 5, 1, 0, 0)
    now = last + timedelta(minutes=250)

    ticks, recorded = due_ticks(every_minute, last, now, "all")

    assert len(ticks) == MAX_CATCH_UP
    assert ticks[0] == now - timedelta(minutes=MAX_CATCH_UP - 1)
    assert ticks[-1] == recorded == now


def test_schedules_are_values() -> None:
    assert isinstance(EVERY_5, CronSchedule)
    assert parse_cron("*/5 * * * *") == EVERY_5
