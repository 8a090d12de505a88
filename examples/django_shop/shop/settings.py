"""The example shop: one app (orders) whose receipts are Django tasks run by skiplock.

The database is DATABASE_URL (any postgresql:// URL), else skiplock's embedded
PostgreSQL 18 (the `embedded` extra), started on first use and left running.
"""

import importlib.util
import os

from psycopg.conninfo import conninfo_to_dict

from skiplock.embedded import embedded_database_url

url = os.environ.get("DATABASE_URL") or embedded_database_url()
database = conninfo_to_dict(url)

SECRET_KEY = "example-only"
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "shop.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "skiplock.contrib.django",  # manage.py migrate installs skiplock's tables; skiplock_worker
    "orders",
]
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.insert(0, "django_tasks")  # Django 5.2: the django-tasks backport

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": database.get("dbname") or "postgres",
        "USER": database.get("user") or "",
        "PASSWORD": database.get("password") or "",
        "HOST": database.get("host") or "",
        "PORT": database.get("port") or "",
    }
}

TASKS = {
    "default": {
        "BACKEND": "skiplock.contrib.django.SkiplockBackend",
        "QUEUES": ["default", "emails"],
        # A schema of its own: the tutorial's and the other examples' jobs, on the same
        # server, are never this worker's.
        "OPTIONS": {
            "DATABASE": "default",
            "SCHEMA": os.environ.get("SKIPLOCK_SCHEMA", "django_shop"),
        },
    }
}

# Receipts are printed by the worker instead of being mailed.
EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
DEFAULT_FROM_EMAIL = "shop@example.com"
