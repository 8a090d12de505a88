"""The worker's keepalive defaults (src/skiplock/worker/keepalives.py): pure, no hosts."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

import skiplock
from skiplock.errors import ConfigurationError
from skiplock.worker.keepalives import keepalive_parameters, with_keepalives


def test_the_parameters_fail_a_silent_connection_in_about_the_timeout() -> None:
    params = keepalive_parameters(30.0)
    assert params["keepalives"] == "1"
    assert params["tcp_user_timeout"] == "30000"  # libpq takes milliseconds
    idle, interval, count = (
        int(params[k]) for k in ("keepalives_idle", "keepalives_interval", "keepalives_count")
    )
    assert idle + interval * count == 30


def test_short_timeouts_keep_whole_seconds_of_at_least_one() -> None:
    params = keepalive_parameters(0.5)
    assert params["keepalives_idle"] == "1" and params["keepalives_interval"] == "1"
    assert params["tcp_user_timeout"] == "500"


def test_what_the_url_sets_wins_and_the_rest_is_added() -> None:
    url = "postgresql://u:secret@a:5432,b:5433/db?target_session_attrs=read-write&keepalives_idle=7"
    merged = conninfo_to_dict(with_keepalives(url, 12.0))
    assert merged["keepalives_idle"] == "7"
    assert merged["tcp_user_timeout"] == "12000"
    assert merged["host"] == "a,b" and merged["port"] == "5432,5433"
    assert merged["password"] == "secret" and merged["target_session_attrs"] == "read-write"


def test_none_leaves_the_url_alone() -> None:
    url = "postgresql://u@a/db"
    assert with_keepalives(url, None) == url
    full = url + "?" + "&".join(f"{k}={v}" for k, v in keepalive_parameters(5).items())
    assert with_keepalives(full, 30.0) == full


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_worker_refuses_a_timeout_that_is_not_positive(bad: float) -> None:
    app = skiplock.App("postgresql://u@a/db")
    with pytest.raises(ConfigurationError, match="tcp_user_timeout"):
        skiplock.Worker(app, tcp_user_timeout=bad)
    with pytest.raises(ValueError, match="positive"):
        keepalive_parameters(bad)
