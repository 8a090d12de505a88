"""System checks: the database is PostgreSQL through psycopg 3, queue names are storable,
the app is installed, and skiplock's migrations are applied."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings

from skiplock.contrib.django.compat import task_backends


def backend_with(**config: Any) -> Any:
    settings = {"default": {"BACKEND": "skiplock.contrib.django.SkiplockBackend", **config}}
    with override_settings(TASKS=settings):
        return task_backends["default"]


def ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


@pytest.mark.django_db
def test_the_test_settings_pass_every_check() -> None:
    backend = task_backends["default"]
    assert backend.check() == []
    assert backend.check(databases=["default"]) == []
    call_command("check", "--database", "default", verbosity=0)


def test_a_database_that_is_not_postgresql_or_not_configured_is_an_error() -> None:
    [lite] = backend_with(OPTIONS={"DATABASE": "lite"}).check()
    assert lite.id == "skiplock.E002"
    assert "DATABASES['lite']['ENGINE']" in lite.msg
    [missing] = backend_with(OPTIONS={"DATABASE": "nope"}).check()
    assert missing.id == "skiplock.E001"
    assert "TASKS['default']['OPTIONS']['DATABASE']" in missing.msg


def test_a_queue_name_skiplock_cannot_store_is_an_error() -> None:
    messages = backend_with(QUEUES=["default", "bad queue"]).check()
    assert ids(messages) == ["skiplock.E004"]
    assert "'bad queue'" in messages[0].msg


@pytest.mark.django_db
def test_missing_migrations_are_a_warning_naming_the_command() -> None:
    backend = backend_with(OPTIONS={"SCHEMA": "never_migrated"})
    assert backend.check() == []  # static checks only: no query
    [pending] = backend.check(databases=["default"])
    assert pending.id == "skiplock.W001"
    assert "0001_jobs" in pending.msg
    assert "manage.py migrate" in pending.hint


def test_the_app_not_installed_is_a_warning() -> None:
    with override_settings(INSTALLED_APPS=["tests_django.taskapp"]):
        messages = task_backends["default"].check()
    assert ids(messages) == ["skiplock.W003"]
