"""``manage.py skiplock_worker`` refuses the numbers ``skiplock worker`` refuses (they
share skiplock.command_line), naming the option, before anything connects."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

HUGE = "99999999999999999999"


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--concurrency", "0"),
        ("--concurrency", HUGE),
        ("--processes", "0"),
        ("--processes", "1001"),
        ("--prefetch", "-1"),
        ("--lease", "0"),
        ("--poll-interval", "nan"),
        ("--shutdown-timeout", "inf"),
        ("--metrics-port", "70000"),
        ("--history-retention-days", "1e9"),
        ("--tcp-user-timeout", "-1"),
    ],
)
def test_a_number_out_of_range_is_refused_by_name(option: str, value: str) -> None:
    with pytest.raises(CommandError) as refused:
        call_command("skiplock_worker", f"{option}={value}")

    assert f"argument {option}: must be " in str(refused.value)
