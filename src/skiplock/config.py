"""Where the database is: an explicit URL, else SKIPLOCK_DATABASE_URL; the embedded server
only when asked for by name ("embedded"), never as a silent fallback."""

from __future__ import annotations

import os
import re

from skiplock.errors import ConfigurationError
from skiplock.sql import complete, render

DATABASE_URL_ENV = "SKIPLOCK_DATABASE_URL"
SCHEMA_ENV = "SKIPLOCK_SCHEMA"
DEFAULT_SCHEMA = "skiplock"

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,50}$")


# The URL value that asks for the embedded server, wherever a URL is accepted.
EMBEDDED = "embedded"

NO_DATABASE = (
    "no database configured: set SKIPLOCK_DATABASE_URL=postgresql://USER:PASSWORD@HOST/DBNAME "
    "(or pass --database-url, or App(url)). For a throwaway local server, set "
    "SKIPLOCK_DATABASE_URL=embedded (or use App(embedded=True)); it needs "
    "pip install 'skiplock[embedded]'"
)


def resolve_database_url(
    explicit: str | None = None, *, embedded: bool = False, fallback_embedded: bool = False
) -> str:
    """The URL to use: ``explicit``, else SKIPLOCK_DATABASE_URL. The embedded server is
    started only when asked for: ``embedded``, the value "embedded" in either place, or
    ``fallback_embedded`` (demo and bench) when nothing is configured. Otherwise a missing
    URL is a ConfigurationError: production code must not run on a private server that
    nobody else can see."""
    wanted = embedded
    if not wanted:
        configured = explicit or os.environ.get(DATABASE_URL_ENV)
        if configured and configured != EMBEDDED:
            return configured
        wanted = configured == EMBEDDED or fallback_embedded
    if not wanted:
        raise ConfigurationError(NO_DATABASE)
    from skiplock.embedded import embedded_database_url  # noqa: PLC0415 - only when asked

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


def results_notice(schema: str) -> tuple[str, dict[str, str]]:
    """The statement and parameters that wake callers awaiting results (done_channel),
    sent after outcomes are written that nothing else notifies."""
    return render(complete.JOBS_DONE_NOTIFY, schema), {"channel": done_channel(schema)}


def control_channel(schema: str) -> str:
    """Requests to workers (cancel a running job), as 'verb TAB argument'."""
    return f"{schema}.control"


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel; the insert trigger builds the same name from its schema."""
    return f"{schema}.jobs"
