"""Module-level tasks for the tests (the worker finds them by import path)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from skiplock.contrib.django.compat import FRAMEWORK
from tests_django.taskapp.models import Ran

if FRAMEWORK == "django.tasks":
    from django.tasks import task
else:
    from django_tasks import task

# Set by a test to let `hold` finish.
RELEASE = threading.Event()


@task
def add(a: int, b: int = 0) -> int:
    return a + b


@task(queue_name="emails")
def send_email(to: str, subject: str = "hello") -> dict[str, str]:
    return {"to": to, "subject": subject}


@task
def record(label: str) -> None:
    Ran.objects.create(label=label)


@task
def fail(message: str) -> None:
    raise ValueError(message)


@task(takes_context=True)
def flaky(context: Any, label: str) -> dict[str, Any]:
    """Fails its first attempt; returns what its context showed on the second."""
    Ran.objects.create(label=label, attempt=context.attempt)
    if context.attempt == 1:
        raise RuntimeError("first attempt fails")
    result = context.task_result
    return {
        "attempt": context.attempt,
        "id": result.id,
        "status": str(result.status),
        "worker_ids": result.worker_ids,
        "errors": [e.exception_class_path for e in result.errors],
        "args": result.args,
    }


@task(takes_context=True)
def introspect(context: Any, n: int) -> dict[str, Any]:
    result = context.task_result
    return {
        "attempt": context.attempt,
        "id": result.id,
        "status": str(result.status),
        "worker_ids": result.worker_ids,
        "args": result.args,
        "kwargs": result.kwargs,
    }


@task
async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    await Ran.objects.acreate(label=f"async {a}+{b}")
    return a + b


@task
def hold() -> str:
    RELEASE.wait(30)
    return "released"


@task(priority=10)
def urgent(label: str) -> None:
    Ran.objects.create(label=label)


def plain_function() -> None:
    """Not a task: a job naming it fails."""


@task
def gather(label: str) -> dict[str, Any]:
    """A workflow step that returns its parents' results, by step name."""
    import skiplock  # noqa: PLC0415 - only this task needs it

    return {"label": label, "parents": skiplock.parent_results()}
