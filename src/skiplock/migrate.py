"""Versioned schema migrations: numbered SQL files applied in order, safe to run while
workers drain.

Each file runs with ``search_path`` set to the target schema, so one set of files serves
any schema name. Concurrent ``migrate`` calls serialise on an advisory lock.

Each migration commits on its own and waits at most ``lock_timeout`` for each lock it
needs. A migration that must wait longer (a long transaction holds its table) gives up,
so claims and completions never queue behind its lock request for longer than that, and
is retried with back-off a few times; after the last attempt the error names it and says
that it can simply be run again.

A file whose first lines hold ``-- skiplock: no-transaction`` runs statement by statement
outside a transaction, for what PostgreSQL refuses inside one (``CREATE INDEX
CONCURRENTLY``, which builds an index without blocking writes). Such a file must be
re-runnable from its first statement: every statement idempotent (``IF NOT EXISTS``), and
a concurrent index build that failed half-way (an INVALID index of that name) is dropped
and built again. See docs/operations.md, "Migrations while workers run".
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from skiplock.config import validate_schema
from skiplock.errors import ConfigurationError, SchemaNotReadyError, SkiplockError
from skiplock.retry import RetryPolicy

log = logging.getLogger("skiplock.migrate")

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_NO_TRANSACTION = re.compile(r"^--\s*skiplock:\s*no-transaction\s*$", re.MULTILINE)
_CONCURRENT_INDEX = re.compile(
    r"^\s*CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+(IF\s+NOT\s+EXISTS\s+)?"
    r"(\"[^\"]+\"|[a-z_][a-z0-9_$]*)",
    re.IGNORECASE,
)

LOCK_TIMEOUT_ENV = "SKIPLOCK_MIGRATE_LOCK_TIMEOUT"
# Seconds a migration's statement may wait for a lock. Half a second: a claim that queues
# behind the request (every lock on jobs does, once an ACCESS EXCLUSIVE request waits)
# is held up at most that long, below the second a claim may be blocked.
DEFAULT_LOCK_TIMEOUT = 0.5
ATTEMPTS = 5
# Waits between attempts: 0.5, 1, 2, 4 s (jittered), so five attempts span about 8 s.
RETRY = RetryPolicy(base=0.5, factor=2.0, cap=8.0, jitter=0.5)

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

_RECORD = """
INSERT INTO {schema}.schema_migrations (version, name) VALUES (%s, %s)
ON CONFLICT (version) DO NOTHING
"""

_LOCK = "SELECT pg_advisory_lock(hashtext(%s))"
_UNLOCK = "SELECT pg_advisory_unlock(hashtext(%s))"

_SETTINGS = """
SELECT set_config('search_path', %(search_path)s, %(local)s),
       set_config('lock_timeout', %(lock_timeout)s, %(local)s)
"""

_CURRENT_SETTINGS = """
SELECT current_setting('search_path'), current_setting('lock_timeout')
"""

# A concurrent build that failed (or was cancelled) leaves an INVALID index behind, which
# IF NOT EXISTS would then keep for good.
_INVALID_INDEX = """
SELECT NOT i.indisvalid FROM pg_index AS i WHERE i.indexrelid = to_regclass(%s)
"""

_DROP_INDEX_CONCURRENTLY = "DROP INDEX CONCURRENTLY IF EXISTS {index}"


class MigrationLockTimeoutError(SkiplockError):
    """A migration could not get its locks within lock_timeout on any attempt. Nothing of
    it was applied (or, for a no-transaction migration, only idempotent steps that its
    next run repeats); running ``skiplock migrate`` again later is safe."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str = field(repr=False)

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    @property
    def transactional(self) -> bool:
        return _NO_TRANSACTION.search(self.sql) is None


def available_migrations() -> list[Migration]:
    """Every migration shipped with this version of skiplock, in order."""
    found = []
    for entry in resources.files("skiplock.migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    return found


def head_version() -> int:
    return available_migrations()[-1].version


def no_transaction_statements(migration: Migration) -> list[str]:
    """The statements of a no-transaction migration, in order; pure.

    Statements end with ``;`` at the end of a line. Dollar quotes are refused (a function
    body belongs in a transactional migration), and so is a concurrent index build without
    IF NOT EXISTS, which a second run could not repeat.
    """
    if "$" in re.sub(r"--[^\n]*", "", migration.sql):
        raise ConfigurationError(
            f"migration {migration.label}: a no-transaction migration holds plain "
            "statements only (no dollar quotes); put functions in a transactional one"
        )
    statements: list[str] = []
    current: list[str] = []
    for line in migration.sql.splitlines():
        code = line.split("--", 1)[0].rstrip()
        if not code.strip():
            continue
        current.append(code)
        if code.endswith(";"):
            statements.append("\n".join(current).rstrip(";").strip())
            current = []
    if current:
        raise ConfigurationError(
            f"migration {migration.label}: its last statement does not end with ';'"
        )
    for statement in statements:
        match = _CONCURRENT_INDEX.match(statement)
        if match and not match[1]:
            raise ConfigurationError(
                f"migration {migration.label}: CREATE INDEX CONCURRENTLY needs IF NOT EXISTS "
                "so that a migration interrupted half-way can run again"
            )
    return statements


def lock_timeout_seconds(explicit: float | None = None) -> float:
    """The lock timeout to use: ``explicit``, else $SKIPLOCK_MIGRATE_LOCK_TIMEOUT, else the
    default."""
    value: Any = explicit
    if value is None:
        value = os.environ.get(LOCK_TIMEOUT_ENV) or DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 3600:
        raise ConfigurationError(
            f"migration lock timeout must be seconds in (0, 3600], got {value!r} "
            f"(from the argument or ${LOCK_TIMEOUT_ENV})"
        )
    return seconds


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> set[int]:
    """Versions recorded in the schema's ledger (empty when the schema does not exist)."""
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".schema_migrations',)
    ).fetchone()
    if not exists or not exists[0]:
        return set()
    rows = conn.execute(
        sql.SQL("SELECT version FROM {}.schema_migrations").format(sql.Identifier(schema))
    ).fetchall()
    return {int(row[0]) for row in rows}


def pending_migrations(conn: psycopg.Connection[Any], schema: str) -> list[Migration]:
    done = applied_versions(conn, schema)
    return [m for m in available_migrations() if m.version not in done]


def migrate(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    target: int | None = None,
    lock_timeout: float | None = None,
    attempts: int = ATTEMPTS,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> list[Migration]:
    """Apply pending migrations up to ``target`` (default: all). Returns what was applied.

    Each migration commits on its own (a failure leaves the schema as the previous
    migration left it) and waits at most ``lock_timeout`` seconds for any lock; one that
    times out is tried again ``attempts`` times in all, then MigrationLockTimeoutError.
    ``conn`` must not be inside a transaction; it is used in autocommit mode.
    """
    validate_schema(schema)
    seconds = lock_timeout_seconds(lock_timeout)
    if attempts < 1:
        raise ConfigurationError(f"attempts must be at least 1, got {attempts}")
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ConfigurationError(
            "migrate needs a connection outside a transaction: a no-transaction migration "
            "cannot run inside one, and each migration commits on its own"
        )
    rng = rng or random.Random()
    ident = sql.Identifier(schema)
    lock_key = f"skiplock.migrate.{schema}"
    was_autocommit = conn.autocommit
    conn.autocommit = True
    saved = conn.execute(_CURRENT_SETTINGS).fetchone()
    applied: list[Migration] = []
    # One migrator at a time per schema, for the whole run: a session lock, since
    # migrations commit one by one and a no-transaction one commits statement by statement.
    conn.execute(_LOCK, (lock_key,))
    try:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(sql.SQL(_CREATE_LEDGER).format(schema=ident))
        for migration in pending_migrations(conn, schema):
            if target is not None and migration.version > target:
                break
            _apply_with_retries(conn, schema, migration, seconds, attempts, sleep, rng)
            applied.append(migration)
    finally:
        if not conn.closed and not conn.broken:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.rollback()
            conn.execute(_UNLOCK, (lock_key,))
            if saved is not None:
                conn.execute(
                    _SETTINGS,
                    {"search_path": saved[0], "lock_timeout": saved[1], "local": False},
                )
            conn.autocommit = was_autocommit
    return applied


def _apply_with_retries(
    conn: psycopg.Connection[Any],
    schema: str,
    migration: Migration,
    lock_timeout: float,
    attempts: int,
    sleep: Callable[[float], None],
    rng: random.Random,
) -> None:
    for attempt in range(1, attempts + 1):
        try:
            _apply(conn, schema, migration, lock_timeout)
            return
        except psycopg.errors.LockNotAvailable as exc:
            if attempt == attempts:
                raise MigrationLockTimeoutError(
                    f"migration {migration.label} could not get its locks within "
                    f"lock_timeout {lock_timeout:g}s on any of {attempts} attempts "
                    f"({str(exc).strip()}); a long transaction is holding a table it "
                    "changes. Nothing of it was applied; run `skiplock migrate` again "
                    f"later (a longer wait: ${LOCK_TIMEOUT_ENV})"
                ) from exc
            delay = RETRY.delay(attempt, rng)
            log.warning(
                "migration %s waited lock_timeout %gs for a lock (attempt %d of %d); "
                "retrying in %.1fs",
                migration.label,
                lock_timeout,
                attempt,
                attempts,
                delay,
            )
            sleep(delay)


def _apply(
    conn: psycopg.Connection[Any], schema: str, migration: Migration, lock_timeout: float
) -> None:
    ident = sql.Identifier(schema)
    settings = {
        "search_path": sql.Identifier(schema).as_string(None),
        "lock_timeout": f"{round(lock_timeout * 1000)}ms",
    }
    record = sql.SQL(_RECORD).format(schema=ident)
    if migration.transactional:
        with conn.transaction():
            conn.execute(_SETTINGS, {**settings, "local": True})
            conn.execute(migration.sql.encode())
            conn.execute(record, (migration.version, migration.name))
        return
    statements = no_transaction_statements(migration)
    conn.execute(_SETTINGS, {**settings, "local": False})
    for statement in statements:
        match = _CONCURRENT_INDEX.match(statement)
        if match:
            index = f"{settings['search_path']}.{match[2]}"
            invalid = conn.execute(_INVALID_INDEX, (index,)).fetchone()
            if invalid and invalid[0]:
                log.warning(
                    "migration %s: index %s was left invalid by an interrupted build; "
                    "building it again",
                    migration.label,
                    index,
                )
                conn.execute(sql.SQL(_DROP_INDEX_CONCURRENTLY).format(index=sql.SQL(index)))
        conn.execute(statement.encode())
    conn.execute(record, (migration.version, migration.name))


def check_schema_ready(conn: psycopg.Connection[Any], schema: str) -> None:
    """Fail with the command to run when the schema is missing or behind."""
    pending = pending_migrations(conn, schema)
    if pending:
        names = ", ".join(m.label for m in pending)
        raise SchemaNotReadyError(
            f"schema {schema!r} is missing migrations ({names}); "
            "run `skiplock migrate` (or App.migrate()) first"
        )
