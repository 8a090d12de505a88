"""The public surface is pinned: adding or removing a name must change this test too."""

from __future__ import annotations

import types

import skiplock

PUBLIC = [
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


def test_all_is_pinned_and_sorted() -> None:
    assert skiplock.__all__ == PUBLIC
    assert skiplock.__all__ == sorted(skiplock.__all__)


def test_every_public_name_exists() -> None:
    missing = [name for name in skiplock.__all__ if not hasattr(skiplock, name)]

    assert missing == []


def test_nothing_public_is_left_out_of_all() -> None:
    exported = {
        name
        for name, value in vars(skiplock).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }

    assert exported == set(PUBLIC)


def test_errors_share_one_base() -> None:
    errors = [
        skiplock.ConfigurationError,
        skiplock.EnqueueError,
        skiplock.JobFailedError,
        skiplock.JobNotFoundError,
        skiplock.SchemaNotReadyError,
        skiplock.UnknownTaskError,
        skiplock.WaitTimeout,
    ]

    assert all(issubclass(error, skiplock.SkiplockError) for error in errors)
    # Retry and Snooze steer a job; they are not errors of skiplock's.
    assert not issubclass(skiplock.Retry, skiplock.SkiplockError)
    assert not issubclass(skiplock.Snooze, skiplock.SkiplockError)


def test_job_states_are_one_vocabulary() -> None:
    assert {state.value for state in skiplock.JobState} == {
        "waiting",
        "blocked",
        "scheduled",
        "available",
        "running",
        "retryable",
        "dead",
        "completed",
        "cancelled",
    }
    assert str(skiplock.JobState.DEAD) == "dead"
