"""A worker's sessions: the lock that says the worker lives, and their names.

A worker is alive while any of the sessions it opens for its own duties is (decision
014). Each of them (the listener, the heartbeat's connection, every connection of the
worker's pools) takes a shared advisory lock on the worker's key right after it connects
(maintenance.WORKER_LOCK); a rescuer's exclusive try-lock on that key (WORKERS_GONE,
LEADER_ELECT) succeeds only once the last of them has closed. So one dropped connection
(the listener's to an idle-session timeout, a proxy or a DBA's pg_terminate_backend)
leaves the worker alive, and a killed process, whose backends all exit at once, is dead
at once. Advisory locks need no privilege and work the same whatever role each session
runs as.

Every such session is also named ``skiplock <purpose> <worker id>`` in
``application_name``, so an operator finds one worker's listener, heartbeat and pool
connections in ``pg_stat_activity``. A name the user chose (in the URL or ``PGAPPNAME``)
wins: the names are for people; liveness does not read them.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import psycopg

from skiplock.sql import maintenance, render

# PostgreSQL truncates application_name to NAMEDATALEN - 1 bytes.
APPLICATION_NAME_MAX = 63


def session_name(purpose: str, worker_id: UUID) -> str:
    """``skiplock listener 5f0c…``: what the session is for, and whose it is."""
    name = f"skiplock {purpose} {worker_id}"
    if len(name.encode()) > APPLICATION_NAME_MAX:
        raise ValueError(f"session name {name!r} is longer than {APPLICATION_NAME_MAX} bytes")
    return name


def session_kwargs(purpose: str, worker_id: UUID) -> dict[str, Any]:
    """Connection keyword arguments that name the session, unless the user named it."""
    return {"fallback_application_name": session_name(purpose, worker_id)}


class LivenessLock:
    """Takes the worker's shared liveness lock on a session: ``await lock(conn)`` for an
    async connection (a pool's ``configure``), ``lock.take(conn)`` for a sync one. Does
    nothing for a worker without a liveness lock (``--no-liveness-lock``, behind a pooler
    in transaction mode, where a session lock would stay on a server connection that
    other clients share)."""

    def __init__(self, schema: str, worker_id: UUID, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.statement = render(maintenance.WORKER_LOCK, schema)
        self.params = {"id": worker_id}

    async def __call__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if self.enabled:
            await conn.execute(self.statement, self.params)

    def take(self, conn: psycopg.Connection[Any]) -> None:
        if self.enabled:
            conn.execute(self.statement, self.params)
