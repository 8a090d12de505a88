"""An App with routes for the routing tests' worker and status processes
(``tests.routing_app:app``): queue "reports" on ``SKIPLOCK_TEST_REPORTS_URL``, every other
queue on ``SKIPLOCK_DATABASE_URL``. The test sets both for the process."""

from __future__ import annotations

import os

import skiplock

app = skiplock.App(
    schema="skiplock", queue_databases={"reports": os.environ["SKIPLOCK_TEST_REPORTS_URL"]}
)


@app.task(queue="reports", name="routing.report")
def report(n: int) -> int:
    return n


@app.task(queue="emails", name="routing.email")
def email(n: int) -> int:
    return n
