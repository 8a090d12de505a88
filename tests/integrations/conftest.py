"""The plugin's fixtures, pointed at this run's database: ``skiplock_database_url`` is
the run's database (tests/conftest.py) and ``skiplock_app`` the shop's App, as a user's
conftest.py would override them."""

from __future__ import annotations

import pytest

import skiplock
from integrations import shop


@pytest.fixture(scope="session")
def skiplock_database_url(database_url: str) -> str:
    return database_url


@pytest.fixture(scope="session")
def skiplock_app(skiplock_database_url: str, skiplock_schema: str) -> skiplock.App:
    shop.app.configure(database_url=skiplock_database_url, schema=skiplock_schema)
    return shop.app
