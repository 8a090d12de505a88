"""Steps a running step adds to its own workflow: fan-out found at run time (migration
0025, decision 024).

    @app.task()
    def crawl(url: str) -> None:
        links = fetch_links(url)
        skiplock.add_steps({f"page {link}": page.job(url=link) for link in links})

The new steps run after the step that adds them (its result is their parent result), and
the steps that ran after it wait for them too: a report after ``crawl`` sees every page.
Names make it idempotent: an attempt that runs again after a crash or a failure and adds
the same names adds nothing, and gets the steps the first attempt added. Only the live
attempt adds (lease mode's fencing token): one whose lease was lost is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from skiplock.context import current_job
from skiplock.errors import ConfigurationError, EnqueueError
from skiplock.results import JobRef
from skiplock.sql import render
from skiplock.sql import workflows as statements
from skiplock.tasks import JobSpec
from skiplock.types import ClaimedJob
from skiplock.workflow import MAX_STEPS, _apps_with, _check_text, _Node, step_columns

if TYPE_CHECKING:
    from skiplock.app import App


def _adding(steps: Mapping[str, JobSpec]) -> tuple[App, ClaimedJob, dict[str, JobSpec]]:
    """The running step's App and job, and the steps checked; nothing is written."""
    job = current_job()
    apps = _apps_with({job.task})
    if not apps:  # pragma: no cover - the worker runs only tasks of an App
        raise RuntimeError(f"no App in this process has task {job.task!r}")
    app = apps[0]
    if app.tasks[job.task].options.transactional:
        raise ConfigurationError(
            "add_steps is for lease-mode steps: a transactional step's attempt holds its row "
            "until it ends, and the steps it adds would not be fenced by it"
        )
    if not isinstance(steps, Mapping):
        raise ConfigurationError(
            f"add_steps takes a mapping of step name to job, got {type(steps).__name__}"
        )
    if len(steps) > MAX_STEPS:
        raise ConfigurationError(f"add at most {MAX_STEPS:,} steps at a time")
    for name, spec in steps.items():
        _check_text("step name", name)
        if not isinstance(spec, JobSpec):
            raise ConfigurationError(
                f"step {name!r} is a job from task.job(...), got {type(spec).__name__}"
            )
        if spec.unique_key is not None:
            raise ConfigurationError(f"step {name!r}: unique jobs cannot be workflow steps")
    return app, job, dict(steps)


def _reserve_params(job: ClaimedJob, steps: Mapping[str, JobSpec]) -> dict[str, Any]:
    return {"adder": job.id, "attempt": job.attempts, "names": list(steps)}


def _fresh(rows: Sequence[Sequence[Any]]) -> tuple[dict[str, int], dict[str, int]]:
    """(new step names -> numbers, in the order given; names that existed -> job ids)."""
    fresh = {str(name): int(number) for name, number, existing in rows if existing is None}
    existing = {str(name): int(job_id) for name, _, job_id in rows if job_id is not None}
    return fresh, existing


def _add_params(
    job: ClaimedJob, steps: Mapping[str, JobSpec], fresh: Mapping[str, int]
) -> dict[str, Any]:
    nodes = [_Node(steps[name], name, (), None, True) for name in fresh]
    given = step_columns(nodes, run_anyway=False)
    given["w"] = [1] * len(nodes)  # waiting for the adder
    return {"adder": job.id, "numbers": list(fresh.values()), "given": json.dumps(given)}


def _refs(
    app: App, fresh: Mapping[str, int], ids: Sequence[int] | None, existing: Mapping[str, int]
) -> dict[str, JobRef]:
    made = dict(zip(fresh, ids or (), strict=True))
    return {name: JobRef(int(i), app) for name, i in {**existing, **made}.items()}


def add_steps(
    steps: Mapping[str, JobSpec], conn: psycopg.Connection[Any] | None = None
) -> dict[str, JobRef]:
    """Inside a running lease-mode step: add ``steps`` (step name -> ``task.job(...)``) to
    its workflow, after it. Written in ``conn``'s transaction, or in a short one of its
    own, committed before this returns. Returns each step's JobRef by name, those added by
    an earlier attempt included. EnqueueError if this attempt is no longer the live one
    or the workflow has ended."""
    app, job, checked = _adding(steps)
    if conn is not None:
        return _add(app, conn, job, checked)
    with psycopg.connect(app.database_url_for(job.queue)) as own:
        return _add(app, own, job, checked)


def _add(
    app: App, conn: psycopg.Connection[Any], job: ClaimedJob, steps: Mapping[str, JobSpec]
) -> dict[str, JobRef]:
    try:
        # One transaction (a savepoint in the caller's): the counts and the rows together.
        with conn.transaction():
            rows = conn.execute(
                render(statements.STEPS_RESERVE, app.schema), _reserve_params(job, steps)
            ).fetchall()
            fresh, existing = _fresh(rows)
            ids = None
            if fresh:
                row = conn.execute(
                    render(statements.STEPS_ADD, app.schema), _add_params(job, steps, fresh)
                ).fetchone()
                ids = row[0] if row else None
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:
        raise EnqueueError(str(exc).strip().splitlines()[0]) from None
    return _refs(app, fresh, ids, existing)


async def add_steps_async(
    steps: Mapping[str, JobSpec], conn: psycopg.AsyncConnection[Any] | None = None
) -> dict[str, JobRef]:
    """``add_steps`` for async handlers."""
    app, job, checked = _adding(steps)
    if conn is not None:
        return await _add_async(app, conn, job, checked)
    async with await psycopg.AsyncConnection.connect(app.database_url_for(job.queue)) as own:
        return await _add_async(app, own, job, checked)


async def _add_async(
    app: App, conn: psycopg.AsyncConnection[Any], job: ClaimedJob, steps: Mapping[str, JobSpec]
) -> dict[str, JobRef]:
    try:
        async with conn.transaction():
            cur = await conn.execute(
                render(statements.STEPS_RESERVE, app.schema), _reserve_params(job, steps)
            )
            fresh, existing = _fresh(await cur.fetchall())
            ids = None
            if fresh:
                cur = await conn.execute(
                    render(statements.STEPS_ADD, app.schema), _add_params(job, steps, fresh)
                )
                row = await cur.fetchone()
                ids = row[0] if row else None
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:
        raise EnqueueError(str(exc).strip().splitlines()[0]) from None
    return _refs(app, fresh, ids, existing)
