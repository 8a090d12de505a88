"""Workers behind a connection pooler in transaction mode (PgBouncer), and telling one.

A pooler in transaction mode lends a server connection to a client for one transaction
at a time, so anything that lives in a *session* means nothing through it: ``LISTEN``
(notifications go to whichever client holds that server connection next, or nobody),
session advisory locks (the worker's liveness lock, decision 014), ``SET`` and the
libpq ``options`` startup parameter (PgBouncer refuses it: "unsupported startup
parameter: options"), and server-side prepared statements, which PgBouncer tracks only
from version 1.21 (``max_prepared_statements``; Debian 12 ships 1.18).

So a worker told it is behind one (``pooler=True``) sends every claim, completion and
maintenance statement through the pooled URL with ``prepare_threshold=None`` and no
``options``, takes no lock on those connections, and keeps its session features on a
second URL when it has one (``listen_url``: PostgreSQL directly, or a session-mode
pool): the listener and the heartbeat connect there and hold the liveness lock. Without
one it polls (``listen=False``, every ``POLL_ONLY_INTERVAL``) and its jobs are rescued by
lease expiry alone, as with ``--no-liveness-lock``.

``detect_transaction_pooling`` tells such a pooler from a direct connection (``skiplock
doctor`` runs it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from skiplock.errors import ConfigurationError

LISTEN_URL_ENV = "SKIPLOCK_LISTEN_URL"
# Poll intervals: with a listener a poll is only the fallback for a lost notification;
# without one it is how a worker finds new jobs, so it sets their start latency. On an
# idle queue a poll is one claim statement per queue that returns nothing from the
# claim cursor's position (cursor.py): 5 cheap statements a second per queue.
POLL_INTERVAL = 1.0
POLL_ONLY_INTERVAL = 0.2


@dataclass(frozen=True)
class WorkerConnections:
    """Where a worker's sessions go, and with which connection arguments.

    ``url`` carries everything that fits in one transaction (claims, completions,
    maintenance, transactional sessions). ``listen_url``, when given, carries the
    sessions that must stay on one server connection: the listener and the heartbeat
    (a dedicated connection anyway), which hold the liveness lock.
    """

    url: str
    listen_url: str | None = None
    pooler: bool = False

    @property
    def dedicated_url(self) -> str:
        """The URL of the listener's and the heartbeat's connections."""
        return self.listen_url or self.url

    def pooled(self, options: str) -> dict[str, Any]:
        """Connection arguments for a connection to ``url``: session settings through
        libpq ``options`` when direct; through a pooler none (it would refuse the
        connection) and no server-side prepared statements (another client's server
        connection would not have them)."""
        if self.pooler:
            return {"prepare_threshold": None}
        return {"options": options} if options else {}

    def dedicated(self, options: str) -> dict[str, Any]:
        """Connection arguments for a connection to ``dedicated_url``."""
        if self.listen_url is not None:
            return {"options": options} if options else {}
        return self.pooled(options)

    @property
    def session_locks(self) -> bool:
        """Whether connections to ``url`` may hold the liveness lock."""
        return not self.pooler


def resolve_poll_interval(poll_interval: float | None, listen: bool) -> float:
    """The poll interval a worker uses: the one given, else 1 s with a listener and
    0.2 s without one (polling is then the only way it hears of new jobs)."""
    if poll_interval is None:
        return POLL_INTERVAL if listen else POLL_ONLY_INTERVAL
    return poll_interval


def check_worker_connections(*, pooler: bool, listen: bool, listen_url: str | None) -> bool:
    """Whether the worker listens, given its settings; refuses the one that cannot work.

    Behind a pooler without a ``listen_url`` there is nowhere to LISTEN: the worker then
    polls (as with ``listen=False``)."""
    if listen_url is not None and not listen_url.strip():
        raise ConfigurationError("listen_url is empty: give a URL or leave it out")
    if pooler and listen_url is None:
        return False
    return listen


# -- telling a transaction-mode pooler ---------------------------------------------------


@dataclass(frozen=True)
class PoolingReport:
    """What ``detect_transaction_pooling`` saw. ``transaction_pooling`` is the verdict;
    ``evidence`` says why, in words for ``skiplock doctor``."""

    transaction_pooling: bool
    evidence: str


# How long the probe's second transaction may wait for a server connection while the
# other client holds one. A direct connection answers at once; a pooler whose pool has a
# single server connection makes it wait, which is evidence too.
WAIT_SECONDS = 3.0

_BACKEND = "SELECT pg_backend_pid()"


def detect_transaction_pooling(
    connect: Callable[[], psycopg.Connection[Any]], *, wait_seconds: float = WAIT_SECONDS
) -> PoolingReport:
    """Whether connections from ``connect`` go through a pooler in transaction (or
    statement) mode.

    Two client connections, A and B (autocommit). A reads its backend's pid; B opens a
    transaction and reads its own, so it holds a server connection; A reads its pid
    again. Directly (or through a session-mode pool) each client keeps its backend: A
    sees the same pid twice and B another. Through a transaction-mode pool A's backend
    went back to the pool after its first statement: B is lent it (PgBouncer lends the
    most recently used server connection first), and A's second statement runs on
    another backend, or waits for one when the pool has a single server connection.
    """
    with connect() as first, connect() as second:
        first.autocommit = True
        second.autocommit = True
        before = _pid(first)
        second.execute("BEGIN")
        held = _pid(second)
        after: list[int] = []
        failure: list[BaseException] = []

        def read_again() -> None:
            try:
                after.append(_pid(first))
            except BaseException as exc:  # reported below, in this thread
                failure.append(exc)

        reader = threading.Thread(target=read_again, name="skiplock-pooler-probe")
        reader.start()
        reader.join(wait_seconds)
        waited = reader.is_alive()
        second.execute("ROLLBACK")  # lets a waiting A have the server connection
        reader.join()
        if failure:
            raise failure[0]
    if waited:
        return PoolingReport(
            True,
            f"a statement waited over {wait_seconds:g}s for a server connection while "
            "another client held one in a transaction",
        )
    if held == before or after[0] != before:
        return PoolingReport(
            True,
            f"one client connection ran on backend {before}, then on {after[0]}, while "
            f"another client's transaction ran on {held}",
        )
    return PoolingReport(False, f"each client connection kept its own backend ({before}, {held})")


def _pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(_BACKEND).fetchone()
    assert row is not None
    return int(row[0])
