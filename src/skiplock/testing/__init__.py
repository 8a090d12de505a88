"""Helpers for testing code that uses skiplock, on a real PostgreSQL (docs/testing.md).

There is no in-memory fake: its semantics would drift from the SQL. Jobs are read from
skiplock's own tables (``enqueued_jobs``, ``assert_enqueued``, ``refute_enqueued``) and
run as a worker runs them (``perform_job``, ``drain``): the executor's code calls the
handler and decides what the attempt came to, and the worker's statements claim the job
and write its outcome. The pytest fixtures are in ``skiplock.pytest_plugin``.

``perform_job_async`` and ``drain_async`` are written once, in ``running_async``;
``running`` (``perform_job``, ``drain``) is generated from it by tools/async_to_sync.py.
"""

from skiplock.testing.enqueued import assert_enqueued, enqueued_jobs, refute_enqueued
from skiplock.testing.running import drain, perform_job
from skiplock.testing.running_async import drain_async, perform_job_async
from skiplock.testing.runs import JobOutcome

__all__ = [
    "JobOutcome",
    "assert_enqueued",
    "drain",
    "drain_async",
    "enqueued_jobs",
    "perform_job",
    "perform_job_async",
    "refute_enqueued",
]
