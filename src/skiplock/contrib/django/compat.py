"""The Tasks framework's names, from Django 6's ``django.tasks`` or, on Django 4.2 to 5.2,
from the ``django-tasks`` backport (module ``django_tasks``). Everything else in this
package imports them from here, so that either works and nothing else has to know which:
Django 6's framework is preferred when both are installed.

The backport spells one exception differently (``InvalidTaskError``); it is exported under
Django 6's name, ``InvalidTask``. The names are typed Any: Django ships no annotations and
the backport's differ.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def _framework() -> tuple[str, ModuleType]:
    for name in ("django.tasks", "django_tasks"):
        try:
            return name, importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        "skiplock.contrib.django needs Django's Tasks framework: Django 6 or later "
        "(django.tasks), or Django 4.2-5.2 with the django-tasks backport; "
        "pip install 'skiplock[django]'"
    )


FRAMEWORK, _tasks = _framework()
_base = importlib.import_module(f"{FRAMEWORK}.base")
_exceptions = importlib.import_module(f"{FRAMEWORK}.exceptions")
_signals = importlib.import_module(f"{FRAMEWORK}.signals")

BaseTaskBackend: Any = importlib.import_module(f"{FRAMEWORK}.backends.base").BaseTaskBackend
Task: Any = _base.Task
TaskContext: Any = _base.TaskContext
TaskError: Any = _base.TaskError
TaskResult: Any = _base.TaskResult
TaskResultStatus: Any = _base.TaskResultStatus
InvalidTask: Any = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
TaskResultDoesNotExist: Any = _exceptions.TaskResultDoesNotExist
task_backends: Any = _tasks.task_backends
task_enqueued: Any = _signals.task_enqueued
task_started: Any = _signals.task_started
task_finished: Any = _signals.task_finished

# For annotations.
DjangoTask = Any
DjangoTaskResult = Any
