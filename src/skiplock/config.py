"""Where the database is: an explicit URL, SKIPLOCK_DATABASE_URL, or the embedded server."""

from __future__ import annotations

import os
import re

from skiplock.errors import ConfigurationError

DATABASE_URL_ENV = "SKIPLOCK_DATABASE_URL"
SCHEMA_ENV = "SKIPLOCK_SCHEMA"
DEFAULT_SCHEMA = "skiplock"

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,50}$")


def resolve_database_url(explicit: str | None = None) -> str:
    """The URL to use; starts the embedded server only when nothing is configured."""
    if explicit:
        return explicit
    from_env = os.environ.get(DATABASE_URL_ENV)
    if from_env:
        return from_env
    from skiplock.embedded import embedded_database_url  # noqa: PLC0415

    return embedded_database_url()


def validate_schema(name: str) -> str:
    """Schema names are plain lowercase identifiers: they become part of channel names."""
    if not _SCHEMA_NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid schema name {name!r}: use lowercase letters, digits and underscores, "
            "starting with a letter or underscore (at most 51 characters)"
        )
    return name


def done_channel(schema: str) -> str:
    """Notified once per batch of written outcomes, for callers awaiting results."""
    return f"{schema}.done"


def control_channel(schema: str) -> str:
    """Requests to workers (cancel a running job), as 'verb TAB argument'."""
    return f"{schema}.control"


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel; the insert trigger builds the same name from its schema."""
    return f"{schema}.jobs"
