"""Workflows of Django tasks, enqueued in the current ``transaction.atomic()``.

    from skiplock.contrib.django.workflows import enqueue_workflow, step

    wf = skiplock.Workflow("checkout")
    charge = wf.add(step(charge_card, order.id))
    wf.add(step(send_receipt, order.id), after=[charge])
    with transaction.atomic():
        order.save()
        ref = enqueue_workflow(wf)   # rolls back with the order

``step`` turns a Django task call into a step, with the task's queue, priority and
``run_after`` (``task.using(...)`` included) and the backend's ``MAX_ATTEMPTS``; the
shorthands (``skiplock.chain``, ``group``, ``chord``) take steps as they take jobs.
Inside a step, ``skiplock.parent_results()`` gives the parents' return values.
"""

from __future__ import annotations

from typing import Any

from skiplock.contrib.django.backend import SkiplockBackend
from skiplock.contrib.django.compat import DjangoTask, InvalidTask, task_backends
from skiplock.contrib.django.worker import DjangoTasksApp
from skiplock.tasks import JobSpec
from skiplock.wording import with_article
from skiplock.workflow import Workflow, WorkflowRef

__all__ = ["enqueue_workflow", "step"]

# One App per backend alias, for the refs enqueue_workflow returns (a ref's result()
# reads through it). Built on first use: a web process that never enqueues a workflow
# builds none.
_apps: dict[str, DjangoTasksApp] = {}


def _backend(alias: str, what: str) -> SkiplockBackend:
    found = task_backends[alias]
    if not isinstance(found, SkiplockBackend):
        raise InvalidTask(
            f"{what} runs on backend {alias!r}, {with_article(type(found).__name__)}; "
            "workflows need skiplock.contrib.django.SkiplockBackend"
        )
    return found


def step(task: DjangoTask, /, *args: Any, **kwargs: Any) -> JobSpec:
    """The call ``task.enqueue(*args, **kwargs)`` would make, as a workflow step. The
    arguments are checked and encoded now, as enqueue checks them."""
    backend = _backend(task.backend, f"task {task.module_path!r}")
    return backend.job_spec(task, args, kwargs)


def enqueue_workflow(workflow: Workflow, /, *, backend: str = "default") -> WorkflowRef:
    """Write ``workflow`` in the current transaction of ``backend``'s database, in one
    statement. Inside ``transaction.atomic()`` it goes in a savepoint of its own, as
    ``task.enqueue`` does: a failed write leaves the caller's transaction usable, and the
    caller's rollback takes every step. Django's ``task_enqueued`` signal is not sent for
    steps."""
    found = _backend(backend, "this workflow")
    app = _apps.get(backend)
    if app is None or app.backend is not found:
        app = _apps[backend] = DjangoTasksApp(found)
    if workflow.app is None:
        workflow.app = app
    elif workflow.app.schema != found.schema:
        raise InvalidTask(
            f"this workflow was built for schema {workflow.app.schema!r}; backend "
            f"{backend!r} keeps its jobs in {found.schema!r}"
        )
    with found.writing() as conn:
        return workflow.enqueue(conn)
