"""skiplock's schema in a Django database: applied by ``manage.py migrate``.

The package's Django migration applies skiplock's migrations once, and a ``post_migrate``
receiver applies those a later skiplock release brings, so ``manage.py migrate`` keeps the
schema current as it does Django's own tables. Only databases that a SkiplockBackend
enqueues into are touched, each with that backend's schema.
"""

from __future__ import annotations

import logging
from typing import Any

from skiplock.migrate import Migration, migrate, pending_migrations

log = logging.getLogger("skiplock.contrib.django")


def skiplock_schemas(alias: str) -> list[str]:
    """The schemas the configured SkiplockBackends keep in database ``alias``."""
    from skiplock.contrib.django.backend import SkiplockBackend  # noqa: PLC0415
    from skiplock.contrib.django.compat import task_backends  # noqa: PLC0415

    schemas = {
        backend.schema
        for backend in task_backends.all()
        if isinstance(backend, SkiplockBackend) and backend.database == alias
    }
    return sorted(schemas)


def apply_schema(connection: Any) -> list[Migration]:
    """Apply skiplock's pending migrations in every schema a backend keeps in the database
    of ``connection`` (a Django connection outside a transaction). Nothing is run when
    none is pending: no CREATE privilege is needed to stay up to date."""
    applied: list[Migration] = []
    for schema in skiplock_schemas(connection.alias):
        connection.ensure_connection()
        if pending_migrations(connection.connection, schema):
            done = migrate(connection.connection, schema)
            for migration in done:
                log.info("skiplock: applied %s in schema %s", migration.label, schema)
            applied.extend(done)
    return applied
