"""Which sessions are a worker's: their names, and the lock that says the worker lives.

Every connection a worker opens for its own duties is named ``skiplock <purpose> <worker
id>`` in ``application_name``, so an operator finds the listener, the heartbeat's and the
pools' connections of one worker in ``pg_stat_activity``. A name the user chose (in the
URL or ``PGAPPNAME``) wins: the names are for people, liveness does not read them.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

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
