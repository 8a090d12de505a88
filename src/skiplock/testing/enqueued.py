"""What a test enqueued: the waiting jobs its connection sees, and assertions on them
whose failure lists what *was* enqueued."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from skiplock import client
from skiplock.app import App
from skiplock.tasks import Task, TaskCall
from skiplock.testing.running import server_now
from skiplock.testing.runs import LIST_LIMIT, Conn, due, listing, show_args
from skiplock.types import Job, JobState

# Jobs that are waiting to run: what "enqueued" means here. Running and dead jobs are not
# (nor finished ones, which are in history).
WAITING = frozenset({JobState.BLOCKED, JobState.SCHEDULED, JobState.AVAILABLE, JobState.RETRYABLE})

Seconds = float | timedelta


def app_and_task(target: App | Task[Any] | TaskCall[Any]) -> tuple[App, str | None]:
    if isinstance(target, App):
        return target, None
    if isinstance(target, TaskCall):
        target = target.task
    if isinstance(target, Task):
        return target.app, target.name
    raise TypeError(f"expected a skiplock App or task, got {type(target).__name__}")


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from jsonb (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def _args_match(stored: dict[str, Any], expected: dict[str, Any] | None) -> bool:
    """Every expected argument is there with that value; others may be there too."""
    if expected is None:
        return True
    return all(key in stored and stored[key] == value for key, value in expected.items())


def enqueued_jobs(
    conn: Conn,
    target: App | Task[Any] | TaskCall[Any],
    /,
    *,
    args: dict[str, Any] | None = None,
    queue: str | None = None,
) -> list[Job]:
    """The jobs waiting to run (blocked, scheduled, available or retryable) that ``conn``
    sees: all of an App's, or a task's, oldest first. ``args`` keeps those that have
    these arguments (and maybe others); ``queue`` those in that queue."""
    app, task = app_and_task(target)
    expected = None if args is None else _as_json(args)
    jobs = client.list_jobs(conn, app.schema, queue=queue, task=task, limit=LIST_LIMIT)
    return [job for job in jobs if job.state in WAITING and _args_match(job.args, expected)]


def _seconds(value: Seconds) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _window(within: Seconds | tuple[Seconds, Seconds]) -> tuple[float, float]:
    """(earliest, latest) seconds from now: a bound alone means from any time to it."""
    if isinstance(within, tuple):
        return _seconds(within[0]), _seconds(within[1])
    return float("-inf"), _seconds(within)


def _wanted(
    task: Task[Any] | TaskCall[Any],
    args: dict[str, Any] | None,
    queue: str | None,
    within: Seconds | tuple[Seconds, Seconds] | None,
) -> str:
    name = app_and_task(task)[1]
    words = [f"job of {name}"]
    if args is not None:
        words.append(f"with arguments ({show_args(args)})")
    if queue is not None:
        words.append(f"in queue {queue!r}")
    if within is not None:
        low, high = _window(within)
        words.append(
            f"due within {high:g}s" if low == float("-inf") else f"due in {low:g}s to {high:g}s"
        )
    return " ".join(words)


def assert_enqueued(
    conn: Conn,
    task: Task[Any] | TaskCall[Any],
    /,
    *,
    args: dict[str, Any] | None = None,
    queue: str | None = None,
    scheduled_within: Seconds | tuple[Seconds, Seconds] | None = None,
    count: int | None = None,
) -> Job:
    """Fail unless ``conn`` sees a waiting job of ``task`` with these ``args`` (and maybe
    others) in ``queue``, due at most ``scheduled_within`` seconds from the transaction's
    now (or a pair: in between), and exactly ``count`` such jobs when given. Returns the
    oldest match. The failure message lists the jobs that *were* enqueued."""
    if count is not None and count < 1:
        raise ValueError(
            f"count={count}: to check that no such job was enqueued, use refute_enqueued"
        )
    app = app_and_task(task)[0]
    now = server_now(conn)
    found = enqueued_jobs(conn, task, args=args, queue=queue)
    if scheduled_within is not None:
        low, high = _window(scheduled_within)
        found = [job for job in found if low <= (due(job) - now).total_seconds() <= high]
    if found and (count is None or len(found) == count):
        return found[0]
    wanted = _wanted(task, args, queue, scheduled_within)
    got = "none was" if not found else f"{len(found)} were"
    expected = f"expected {count} x {wanted}" if count is not None else f"expected a {wanted}"
    raise AssertionError(
        f"{expected}; {got} enqueued.\n" + listing(enqueued_jobs(conn, app), now, "Enqueued jobs")
    )


def refute_enqueued(
    conn: Conn,
    task: Task[Any] | TaskCall[Any],
    /,
    *,
    args: dict[str, Any] | None = None,
    queue: str | None = None,
) -> None:
    """Fail if ``conn`` sees a waiting job of ``task`` with these ``args`` in ``queue``,
    listing the jobs that match."""
    found = enqueued_jobs(conn, task, args=args, queue=queue)
    if found:
        raise AssertionError(
            f"expected no {_wanted(task, args, queue, None)}; found:\n"
            + listing(found, server_now(conn), "Matching jobs")
        )
