"""Settings for the Django integration's tests (tests_django/).

The server is SKIPLOCK_TEST_DSN when set, else the embedded PostgreSQL 18, as for the main
suite. pytest-django creates the database ``test_<NAME>`` for the run and drops it at the
end; NAME is unique per run. A worker process started by a test is given the test
database's name in SKIPLOCK_DJANGO_DATABASE, which is then used as it is.
"""

from __future__ import annotations

import importlib.util
import os

from psycopg.conninfo import conninfo_to_dict

from skiplock import RetryPolicy
from skiplock.embedded import embedded_database_url

SERVER = os.environ.get("SKIPLOCK_TEST_DSN") or embedded_database_url()
_server = conninfo_to_dict(SERVER)

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "skiplock.contrib.django",
    "tests_django.taskapp",
]
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.insert(0, "django_tasks")  # the backport, on Django 5.2

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("SKIPLOCK_DJANGO_DATABASE") or f"skiplock_django_{os.getpid()}",
        "USER": _server.get("user") or "",
        "PASSWORD": _server.get("password") or "",
        "HOST": _server.get("host") or "",
        "PORT": _server.get("port") or "",
    },
    # Not PostgreSQL: for the error a backend configured onto it gives.
    "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}

TASKS = {
    "default": {
        "BACKEND": "skiplock.contrib.django.SkiplockBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {
            "DATABASE": "default",
            "MAX_ATTEMPTS": 2,
            "RETRY": RetryPolicy(base=0.05, cap=0.05, jitter=0.0),
        },
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "root": {"level": "WARNING"},
}
