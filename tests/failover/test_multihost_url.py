"""The worker adds its keepalive parameters to the URL it is given (keepalives.py); a
multi-host URL must keep every host, its port and ``target_session_attrs`` through that,
or a failover would leave the workers on the old primary's address alone."""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict

from skiplock.worker.keepalives import with_keepalives

URL = (
    "postgresql://postgres@10.231.0.1:5432,10.231.0.2:5433/cluster"
    "?target_session_attrs=read-write&connect_timeout=3"
)


def test_keepalives_keep_every_host_of_a_multi_host_url() -> None:
    params = conninfo_to_dict(with_keepalives(URL, 4.0))
    assert params["host"] == "10.231.0.1,10.231.0.2"
    assert params["port"] == "5432,5433"
    assert params["target_session_attrs"] == "read-write"
    assert params["connect_timeout"] == "3"
    assert params["tcp_user_timeout"] == "4000"


def test_without_a_timeout_the_multi_host_url_is_left_as_given() -> None:
    assert with_keepalives(URL, None) == URL
