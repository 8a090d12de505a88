"""TCP keepalives and ``tcp_user_timeout`` on the worker's own connections.

When the network fails rather than the server (a cut link, a host that drops off), a
connection can look open for a long time: an idle one until the kernel's keepalive
(two hours by default, when it is on at all), a busy one until the retransmissions give up
(about fifteen minutes on Linux). Meanwhile a completer or heartbeat waits on it, and after
the link returns the retransmission back-off can keep it waiting a minute or two more.
libpq takes keepalive and ``tcp_user_timeout`` parameters; the worker adds them to its
URL, unless the URL sets them, so that a dead peer costs a connection in about ``timeout``
seconds, which the worker then reconnects.

The server side is the operator's: a partitioned worker's sessions, and the liveness lock
they hold (liveness.py), stay until PostgreSQL itself drops them, which its own
``tcp_keepalives_*`` and ``tcp_user_timeout`` settings bound (docs/cluster.md). Jobs of a
partitioned worker are rescued at the latest when their lease runs out either way.
"""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict, make_conninfo

# Seconds: a dead peer is noticed within about this long (tcp_user_timeout for data not
# acknowledged; keepalive probes for an idle connection, which the same timeout caps on
# Linux). Longer than any stall a healthy network shows, shorter than the default lease.
DEFAULT_TCP_USER_TIMEOUT = 30.0

# Three probes after the connection has been idle for half the timeout, spread over the
# other half.
KEEPALIVE_PROBES = 3


def keepalive_parameters(timeout: float) -> dict[str, str]:
    """The libpq parameters that make a connection whose peer stopped answering fail in
    about ``timeout`` seconds, whether data was waiting for an acknowledgement or not."""
    if not timeout > 0:  # NaN too
        raise ValueError(f"tcp_user_timeout must be positive, got {timeout}")
    idle = max(1, round(timeout / 2))
    interval = max(1, round((timeout - idle) / KEEPALIVE_PROBES))
    return {
        "keepalives": "1",
        "keepalives_idle": str(idle),
        "keepalives_interval": str(interval),
        "keepalives_count": str(KEEPALIVE_PROBES),
        "tcp_user_timeout": str(max(1, round(timeout * 1000))),  # milliseconds
    }


def with_keepalives(url: str, timeout: float | None) -> str:
    """``url`` with the keepalive parameters it does not set itself; unchanged when
    ``timeout`` is None (the operating system's defaults) or the URL sets them all. The
    parameters are ignored on Unix-domain sockets, and ``tcp_user_timeout`` on systems
    without it."""
    if timeout is None:
        return url
    given = conninfo_to_dict(url)
    missing = {k: v for k, v in keepalive_parameters(timeout).items() if k not in given}
    return make_conninfo(url, **missing) if missing else url
