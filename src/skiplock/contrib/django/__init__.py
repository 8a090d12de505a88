"""Django's Tasks framework on skiplock (``pip install 'skiplock[django]'``).

    INSTALLED_APPS = [..., "skiplock.contrib.django"]
    TASKS = {"default": {"BACKEND": "skiplock.contrib.django.SkiplockBackend",
                         "QUEUES": ["default", "emails"],
                         "OPTIONS": {"DATABASE": "default"}}}

``task.enqueue(...)`` then inserts the job in the current transaction of that database;
``manage.py migrate`` installs skiplock's schema; ``manage.py skiplock_worker`` runs the
tasks. Works with Django 6's ``django.tasks`` and with the ``django-tasks`` backport on
Django 4.2-5.2. See docs/django.md.
"""

from __future__ import annotations

from skiplock.contrib.django.backend import SkiplockBackend

__all__ = ["SkiplockBackend"]
