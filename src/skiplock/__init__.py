"""skiplock: a job queue for Python that lives inside PostgreSQL.

Enqueue in your own transaction; workers claim with FOR UPDATE SKIP LOCKED.
"""

from skiplock.added_steps import add_steps, add_steps_async
from skiplock.admin import Admin
from skiplock.admin_async import AsyncAdmin
from skiplock.app import App
from skiplock.batch import Batch, BatchCounts, batch_counts, batch_counts_async
from skiplock.context import cancel_requested, current_job, set_progress
from skiplock.durable import (
    LeaseLostError,
    complete,
    complete_async,
    sleep,
    sleep_async,
    step,
    step_async,
    wait_for,
    wait_for_async,
)
from skiplock.errors import (
    ConfigurationError,
    EnqueueError,
    JobFailedError,
    JobNotFoundError,
    Retry,
    SchemaNotReadyError,
    SkiplockError,
    Snooze,
    UnknownTaskError,
    WaitTimeout,
)
from skiplock.results import JobRef
from skiplock.retry import RetryPolicy
from skiplock.tasks import JobSpec, Task
from skiplock.types import ClaimedJob, Job, JobState
from skiplock.worker import Worker, WorkerOptions
from skiplock.workflow import (
    Step,
    Workflow,
    WorkflowRef,
    chain,
    chord,
    group,
    parent_results,
    parent_results_async,
)

__all__ = [
    "Admin",
    "App",
    "AsyncAdmin",
    "Batch",
    "BatchCounts",
    "ClaimedJob",
    "ConfigurationError",
    "EnqueueError",
    "Job",
    "JobFailedError",
    "JobNotFoundError",
    "JobRef",
    "JobSpec",
    "JobState",
    "LeaseLostError",
    "Retry",
    "RetryPolicy",
    "SchemaNotReadyError",
    "SkiplockError",
    "Snooze",
    "Step",
    "Task",
    "UnknownTaskError",
    "WaitTimeout",
    "Worker",
    "WorkerOptions",
    "Workflow",
    "WorkflowRef",
    "add_steps",
    "add_steps_async",
    "batch_counts",
    "batch_counts_async",
    "cancel_requested",
    "chain",
    "chord",
    "complete",
    "complete_async",
    "current_job",
    "group",
    "parent_results",
    "parent_results_async",
    "set_progress",
    "sleep",
    "sleep_async",
    "step",
    "step_async",
    "wait_for",
    "wait_for_async",
]

__version__ = "0.1.0"
