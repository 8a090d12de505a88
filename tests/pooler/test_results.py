"""``JobRef.result()`` through PgBouncer in transaction mode: the wait polls the job once a
second on a connection of its own, and a server-side prepared statement (psycopg prepares a
query it ran five times) does not survive the pooler handing the next poll to another
server connection (PgBouncer < 1.21). Its connection prepares nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import psycopg
import pytest

import skiplock
from skiplock import results

# Other clients of the pooler, so that consecutive polls land on different server
# connections (an idle pool would hand the same one back every time).
NEIGHBOURS = 4


@pytest.fixture
def busy_pooler(pooled_url: str) -> Iterator[None]:
    stop = threading.Event()

    def neighbour() -> None:
        with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                with conn.transaction():
                    conn.execute("SELECT pg_sleep(0.01)")

    threads = [threading.Thread(target=neighbour, daemon=True) for _ in range(NEIGHBOURS)]
    for thread in threads:
        thread.start()
    yield
    stop.set()
    for thread in threads:
        thread.join(10)


@pytest.fixture
def waited(monkeypatch: pytest.MonkeyPatch) -> float:
    """Seconds to wait: past psycopg's five executions before it prepares, at a fast poll."""
    monkeypatch.setattr(results, "POLL_SECONDS", 0.05)
    return 1.5


def waiting_job(app: skiplock.App, conn: psycopg.Connection[object]) -> skiplock.JobRef:
    task = app.task(name="pooler.results.never")(lambda: None)
    with conn.transaction():
        return task.with_options(delay=3600).enqueue(conn)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_waiting_for_a_result_through_the_pooler_prepares_nothing(
    app: skiplock.App,
    conn: psycopg.Connection[object],
    busy_pooler: None,
    waited: float,
    mode: str,
) -> None:
    ref = waiting_job(app, conn)
    with pytest.raises(TimeoutError):
        if mode == "sync":
            ref.result(timeout=waited)
        else:
            asyncio.run(ref.result_async(timeout=waited))
