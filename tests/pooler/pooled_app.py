"""The app of the command-line test (``tests.pooler.pooled_app:app``): a task that does
nothing, over ``SKIPLOCK_DATABASE_URL`` (the pooler's URL, set by the test)."""

from __future__ import annotations

import skiplock

app = skiplock.App(schema="skiplock")


@app.task(name="pooled")
def pooled(n: int) -> int:
    return n
