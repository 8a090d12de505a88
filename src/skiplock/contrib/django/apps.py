"""The Django app: its migration installs skiplock's schema, its management command runs
the worker. Add ``"skiplock.contrib.django"`` to INSTALLED_APPS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.db import connections
from django.db.models.signals import post_migrate


def _apply_new_migrations(sender: Any, using: str = "default", **kwargs: Any) -> None:
    """After ``migrate``: skiplock migrations that a newer release brought."""
    from skiplock.contrib.django.schema import apply_schema  # noqa: PLC0415

    apply_schema(connections[using])


def check_schemas(
    app_configs: Sequence[Any] | None = None, databases: Sequence[str] | None = None, **_: Any
) -> list[Any]:
    """Database check (``check --database ALIAS``, and before ``migrate``): each backend's
    schema has every skiplock migration."""
    from skiplock.contrib.django.backend import SkiplockBackend  # noqa: PLC0415
    from skiplock.contrib.django.compat import task_backends  # noqa: PLC0415

    messages: list[Any] = []
    for backend in task_backends.all():
        if isinstance(backend, SkiplockBackend):
            messages.extend(backend.check_schema(databases))
    return messages


class SkiplockConfig(AppConfig):
    name = "skiplock.contrib.django"
    label = "skiplock"
    verbose_name = "skiplock"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        post_migrate.connect(_apply_new_migrations, sender=self)
        checks.register(check_schemas, checks.Tags.database)
