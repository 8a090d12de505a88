"""The integrations' public names are pinned, as skiplock's own are (test_public_api.py):
adding or removing one must change this test too."""

from __future__ import annotations

import skiplock.contrib.sqlalchemy
import skiplock.testing

TESTING = [
    "JobOutcome",
    "assert_enqueued",
    "drain",
    "drain_async",
    "enqueued_jobs",
    "perform_job",
    "perform_job_async",
    "refute_enqueued",
]

SQLALCHEMY = [
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "enqueue_workflow",
    "enqueue_workflow_async",
    "get_job",
    "get_job_async",
    "psycopg_connection",
    "psycopg_connection_async",
]


def test_the_testing_helpers_are_pinned() -> None:
    assert skiplock.testing.__all__ == TESTING
    assert all(hasattr(skiplock.testing, name) for name in TESTING)


def test_the_sqlalchemy_functions_are_pinned() -> None:
    assert skiplock.contrib.sqlalchemy.__all__ == SQLALCHEMY
    assert all(hasattr(skiplock.contrib.sqlalchemy, name) for name in SQLALCHEMY)
