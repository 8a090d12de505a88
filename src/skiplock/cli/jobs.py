"""``skiplock jobs``: list and show jobs; retry, cancel or delete one, or every job matching
filters."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from skiplock.admin import Admin
from skiplock.app import App
from skiplock.command_line import JOB_ID, count, seconds
from skiplock.errors import ConfigurationError
from skiplock.sql import render
from skiplock.sql import steps as steps_sql
from skiplock.sql import workflows as workflows_sql
from skiplock.sql.admin import REPLAYABLE_STATES
from skiplock.tasks import MAX_TAG, check_name
from skiplock.types import LIVE_STATES, Job
from skiplock.wording import plural

STATES = list(LIVE_STATES)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("jobs", help="list, show, retry or cancel jobs")
    jobs = p.add_subparsers(dest="jobs_command", required=True)
    q = jobs.add_parser("list", help="live jobs (history is not listed)")
    _add_filters(q)
    q.add_argument("--limit", type=count(1), default=100)
    q.add_argument("--json", action="store_true")
    q = jobs.add_parser("show", help="show one job, live or finished, with every error")
    q.add_argument("id", type=JOB_ID)
    q.add_argument("--json", action="store_true", help="print the job as one JSON object")
    for name, text in (
        (
            "retry",
            "send dead or waiting jobs back to their queue with fresh attempts; enqueue "
            "completed or cancelled ones again, as copies that name them",
        ),
        ("cancel", "cancel jobs that are not running (they move to history)"),
        ("delete", "delete jobs that are not running, leaving no history"),
    ):
        q = jobs.add_parser(name, help=text)
        q.add_argument("id", type=JOB_ID, nargs="?", help="one job; or use --all with filters")
        q.add_argument("--all", action="store_true", help="every job matching the filters")
        # Retry also runs finished jobs again: --state completed or cancelled picks those.
        _add_filters(q, STATES + list(REPLAYABLE_STATES) if name == "retry" else STATES)
        q.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=run)


def _add_filters(parser: argparse.ArgumentParser, states: list[str] = STATES) -> None:
    parser.add_argument("--state", choices=states)
    parser.add_argument("--queue")
    parser.add_argument("--task")
    parser.add_argument("--older-than", type=seconds(), metavar="SECONDS", help="by creation time")
    parser.add_argument("--tag", help="jobs with this tag (with_options(tags=...))")


def _filters(args: argparse.Namespace) -> dict[str, Any]:
    """The filters given (``--state``, ``--queue``, ``--task``, ``--older-than``, ``--tag``);
    a tag no job can carry is refused, naming why."""
    if args.tag is not None:
        check_name("tag", args.tag, MAX_TAG)
    names = ("state", "queue", "task", "older_than", "tag")
    return {name: getattr(args, name) for name in names}


def _fmt_time(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def _job_dict(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "queue": job.queue,
        "task": job.task,
        "state": str(job.state),
        "args": job.args,
        "priority": job.priority,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "run_at": _fmt_time(job.run_at),
        "retry_at": _fmt_time(job.retry_at),
        "created_at": _fmt_time(job.created_at),
        "attempted_at": _fmt_time(job.attempted_at),
        "finished_at": _fmt_time(job.finished_at),
        "worker_id": str(job.worker_id) if job.worker_id else None,
        "errors": job.errors,
        "result": job.result,
        "progress": job.progress,
        "cancel_requested_at": _fmt_time(job.cancel_requested_at),
        "wait_key": job.wait_key,
        "wait_until": _fmt_time(job.wait_until),
        "tags": list(job.tags),
    }


def _indented(text: str, prefix: str = "    ") -> list[str]:
    return [prefix + line for line in text.rstrip("\n").splitlines()] or [prefix]


def _waits(job: Job) -> str | None:
    """What a job waiting for a signal waits for, and until when."""
    if job.wait_key is None:
        return None
    until = f" until {_fmt_time(job.wait_until)}" if job.wait_until else ", no time limit"
    return f"waits for signal {job.wait_key!r}{until}"


def job_view(job: Job) -> list[str]:
    """``jobs show``: one job for a person to read; its fields, its arguments (and result)
    as indented JSON, and each attempt's error with the traceback as real lines. Pure."""
    fields = [
        ("state", str(job.state)),
        ("task", job.task),
        ("queue", job.queue),
        ("priority", str(job.priority)),
        ("attempts", f"{job.attempts} of {job.max_attempts}"),
        ("created", _fmt_time(job.created_at)),
        ("run at", _fmt_time(job.run_at)),
        ("retry at", _fmt_time(job.retry_at) if job.retry_at else None),
        ("last attempt", _fmt_time(job.attempted_at) if job.attempted_at else None),
        ("finished", _fmt_time(job.finished_at) if job.finished_at else None),
        ("worker", str(job.worker_id) if job.worker_id else None),
        ("lease until", _fmt_time(job.lease_expires_at) if job.lease_expires_at else None),
        (
            "cancel asked",
            _fmt_time(job.cancel_requested_at) if job.cancel_requested_at else None,
        ),
        ("waits", _waits(job)),
        ("tags", ", ".join(job.tags) if job.tags else None),
    ]
    lines = [f"job {job.id}"]
    lines += [f"  {name + ':':<14}{value}" for name, value in fields if value is not None]
    lines += ["args:", *_indented(json.dumps(job.args, indent=2, ensure_ascii=False))]
    for name, value in (("progress", job.progress), ("result", job.result)):
        if value is not None:
            lines += [f"{name}:", *_indented(json.dumps(value, indent=2, ensure_ascii=False))]
    if not job.errors:
        lines.append("errors: none")
    for error in job.errors:
        kind = ".".join(
            part for part in (error.get("module"), error.get("type")) if part and part != "builtins"
        )
        lines.append(
            f"attempt {error.get('attempt', '?')} failed"
            + (f" at {error['at']}" if error.get("at") else "")
            + f": {kind or 'Error'}: {str(error.get('message', '')).partition(chr(10))[0]}"
        )
        if error.get("traceback"):
            lines += _indented(str(error["traceback"]))
    return lines


# Names listed in `jobs show` before "and N more": a fan-in's child has thousands.
MOST_NAMES = 10


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MOST_NAMES])
    return shown + (f" and {len(names) - MOST_NAMES} more" if len(names) > MOST_NAMES else "")


def step_lines(step: dict[str, Any] | None) -> list[str]:
    """``jobs show``: the workflow (or batch) the job is a step of. Pure."""
    if step is None:
        return []
    kind = "batch" if step["batch"] else "workflow"
    name = f" {step['workflow_name']!r}" if step["workflow_name"] else ""
    lines = [
        f"{kind}: {step['workflow_id']}{name} ({step['workflow_state']}), step "
        f"{step['name']!r}, {step['step']} of {step['steps']}"
    ]
    if step["parents"]:
        lines.append(f"  after: {_names(step['parents'])}")
    if step["pending"]:
        lines.append(f"  waiting for {step['pending']} more")
    if step["children"]:
        lines.append(f"  before: {_names(step['children'])}")
    return lines


# A recorded step's result is shown up to this many characters.
STEP_RESULT_CHARS = 80


def durable_step_lines(steps: list[dict[str, Any]]) -> list[str]:
    """``jobs show``: the durable steps the job's attempts recorded (skiplock.step). Pure."""
    if not steps:
        return []
    lines = [f"steps recorded: {len(steps)}"]
    for row in steps:
        result = row["result"] if row["result"] is not None else "null"
        if len(result) > STEP_RESULT_CHARS:
            result = result[: STEP_RESULT_CHARS - 3] + "..."
        lines.append(
            f"  {row['name']!r}  attempt {row['attempt']}  {_fmt_time(row['done_at'])}  {result}"
        )
    return lines


def _durable_steps(conn: psycopg.Connection[Any], schema: str, job_id: int) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(steps_sql.STEPS_SHOW, schema), {"id": job_id}).fetchall()


def _step_of(conn: psycopg.Connection[Any], schema: str, job_id: int) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(workflows_sql.STEP_OF_JOB, schema), {"id": job_id}).fetchone()


def run(args: argparse.Namespace) -> int:
    app = App(args.database_url, schema=args.schema)
    with app.connect(autocommit=True) as conn:
        admin = Admin(app, conn)
        if args.jobs_command == "list":
            jobs = admin.list_jobs(**_filters(args), limit=args.limit)
            if args.json:
                print(json.dumps([_job_dict(j) for j in jobs], default=str))
                return 0
            print(f"{'id':>8}  {'state':<10} {'queue':<12} {'attempts':>8}  task / last error")
            for job in jobs:
                print(
                    f"{job.id:>8}  {job.state!s:<10} {job.queue:<12} "
                    f"{job.attempts:>3}/{job.max_attempts:<4}  {job.task}"
                    # One line a job: a message's own lines (PostgreSQL's LINE 1: ...)
                    # would break the table.
                    + (f"  [{job.last_error.splitlines()[0]}]" if job.last_error else "")
                    + (f"  (signal {job.wait_key!r})" if job.wait_key else "")
                    + (f"  #{' #'.join(job.tags)}" if job.tags else "")
                )
            return 0
        if args.jobs_command == "show":
            job = admin.get_job(args.id)
            step = _step_of(conn, app.schema, job.id)
            steps = _durable_steps(conn, app.schema, job.id)
            if args.json:
                shown = _job_dict(job) | {"step": step, "steps": steps}
                print(json.dumps(shown, indent=2, default=str))
            else:
                print("\n".join(job_view(job) + step_lines(step) + durable_step_lines(steps)))
            return 0
        return _jobs_change(args, admin)
    raise AssertionError(args.jobs_command)


_DONE = {"retry": "made available again", "cancel": "cancelled", "delete": "deleted"}


def _replayed(admin: Admin, original: int, copy: int) -> str:
    state = admin.get_job(original).state
    return f"job {original} ({state}) enqueued again as job {copy}"


def _jobs_change(args: argparse.Namespace, admin: Admin) -> int:
    """retry / cancel / delete: one job by id, or every job matching filters (--all),
    after a confirmation unless --yes. Running jobs are never retried or deleted; a
    running job cancelled is asked to stop."""
    command, done = args.jobs_command, _DONE[args.jobs_command]
    if args.id is not None:
        if args.all:
            raise ConfigurationError("give a job id or --all with filters, not both")
        if command == "cancel" and admin.get_job(args.id).state == "running":
            admin.cancel_job(args.id)
            print(f"job {args.id} is running: its worker was asked to stop it (it ends cancelled)")
            return 0
        if command == "retry":
            runs = admin.retry_job(args.id)
            print(f"job {args.id} {done}" if runs == args.id else _replayed(admin, args.id, runs))
            return 0
        {"cancel": admin.cancel_job, "delete": admin.delete_job}[command](args.id)
        print(f"job {args.id} {done}")
        return 0
    if not args.all:
        raise ConfigurationError(
            f"`jobs {command}` needs a job id, or --all with filters "
            "(--state, --queue, --task, --older-than, --tag)"
        )
    ids = admin.job_ids(**_filters(args))  # --state completed: finished ones, in history
    if not ids:
        print("no jobs match")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigurationError(
                f"{plural(len(ids), 'job')} match; pass --yes to {command} them without a prompt"
            )
        answer = input(f"{command} {plural(len(ids), 'job')}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing changed")
            return 1
    change = {"retry": admin.retry_jobs, "cancel": admin.cancel_jobs, "delete": admin.delete_jobs}
    count = change[command](ids)
    if args.state in REPLAYABLE_STATES:
        done = "enqueued again (copies; history keeps the originals)"
    print(
        f"{count} of {plural(len(ids), 'job')} {done}"
        + (" (the rest were running)" if count < len(ids) else "")
    )
    return 0
