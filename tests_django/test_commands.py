"""manage.py: migrate installs and upgrades skiplock's schema; skiplock_worker has the
options of `skiplock worker` and refuses to start on an unmigrated schema."""

from __future__ import annotations

import argparse

import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.test import override_settings

from skiplock import cli
from skiplock.migrate import head_version, pending_migrations

OTHER_SCHEMA = "skiplock_other"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    # The options every skiplock command takes after it too (no default there: SUPPRESS)
    # are the top level's; manage.py has Django's settings for them.
    return {
        s
        for action in parser._actions
        if action.default is not argparse.SUPPRESS
        for s in action.option_strings
    }


def test_skiplock_worker_has_the_options_of_skiplock_worker() -> None:
    worker_parser = next(
        action.choices["worker"]
        for action in cli.build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    command = load_command_class("skiplock.contrib.django", "skiplock_worker")
    ours = option_strings(command.create_parser("manage.py", "skiplock_worker"))
    django_own = option_strings(BaseCommand().create_parser("manage.py", "any"))

    assert ours - django_own - {"--backend"} == option_strings(worker_parser) - {"-h", "--help"}


@pytest.mark.django_db(transaction=True)
def test_migrate_applies_skiplock_migrations_a_schema_lacks() -> None:
    tasks = {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "OPTIONS": {"SCHEMA": OTHER_SCHEMA},
        }
    }
    try:
        with override_settings(TASKS=tasks):
            # Django's own migration is applied already: the post_migrate step does it.
            call_command("migrate", verbosity=0)
        connection.ensure_connection()
        assert pending_migrations(connection.connection, OTHER_SCHEMA) == []
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT max(version) FROM {OTHER_SCHEMA}.schema_migrations")
            assert cursor.fetchone() == (head_version(),)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA IF EXISTS {OTHER_SCHEMA} CASCADE")


@pytest.mark.django_db
def test_the_worker_refuses_an_unmigrated_schema_naming_the_command() -> None:
    tasks = {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "OPTIONS": {"SCHEMA": "never_migrated"},
        }
    }
    with override_settings(TASKS=tasks), pytest.raises(CommandError, match=r"manage\.py migrate"):
        call_command("skiplock_worker")


def test_the_worker_refuses_a_backend_that_is_not_skiplocks() -> None:
    tasks = {"default": {"BACKEND": "skiplock.contrib.django.SkiplockBackend"}}
    with override_settings(TASKS=tasks), pytest.raises(CommandError, match="'nope'"):
        call_command("skiplock_worker", "--backend", "nope")
