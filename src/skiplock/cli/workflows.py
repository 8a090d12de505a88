"""``skiplock workflows``: list workflows, show one as its steps' tree, cancel one."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from skiplock import client
from skiplock.app import App
from skiplock.command_line import JOB_ID, count
from skiplock.errors import JobNotFoundError
from skiplock.sql import render
from skiplock.sql import workflows as statements
from skiplock.types import WORKFLOW_STATES


def add_parser(sub: Any) -> None:
    p = sub.add_parser("workflows", help="list, show or cancel workflows")
    workflows = p.add_subparsers(dest="workflows_command", required=True)
    q = workflows.add_parser("list", help="the newest workflows first")
    q.add_argument("--state", choices=WORKFLOW_STATES)
    q.add_argument("--limit", type=count(1), default=50)
    q.add_argument("--json", action="store_true")
    q = workflows.add_parser("show", help="one workflow: each step's state and parents")
    q.add_argument("id", type=JOB_ID)
    q.add_argument("--json", action="store_true")
    q = workflows.add_parser(
        "cancel", help="cancel a workflow: its waiting steps now, its running ones asked to stop"
    )
    q.add_argument("id", type=JOB_ID)
    p.set_defaults(func=run)


def _time(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def _one(conn: psycopg.Connection[Any], schema: str, workflow_id: int) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(render(statements.WORKFLOW_GET, schema), {"id": workflow_id})
        row = cur.fetchone()
    if row is None:
        raise JobNotFoundError(f"no workflow with id {workflow_id}")
    return row


def _steps(conn: psycopg.Connection[Any], schema: str, workflow_id: int) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(render(statements.WORKFLOW_STEPS, schema), {"id": workflow_id})
        return cur.fetchall()


def workflow_view(workflow: dict[str, Any], steps: list[dict[str, Any]]) -> list[str]:
    """The workflow's header, then one line per step in dependency order, each indented
    under its first parent and naming its other parents."""
    done = workflow["steps"] - workflow["steps_left"]
    options = workflow["options"] if isinstance(workflow["options"], dict) else {}
    kind, note = "workflow", ""
    if options.get("batch"):  # decision 025: step 1 is the callback
        kind = "batch"
        note = " (open: its callback also waits for the close)" if options.get("open") else ""
    lines = [
        f"{kind} {workflow['id']}"
        + (f" {workflow['name']!r}" if workflow["name"] else "")
        + note
        + f": {workflow['state']}, {done}/{workflow['steps']} steps ended"
        + (f", {workflow['steps_failed']} failed" if workflow["steps_failed"] else ""),
        f"  created {_time(workflow['created_at'])}, finished {_time(workflow['finished_at'])}",
    ]
    by_number = {step["step"]: step for step in steps}
    children: dict[int, list[int]] = {}
    for step in steps:
        if step["parents"]:
            children.setdefault(step["parents"][0], []).append(step["step"])

    def visit(number: int, depth: int) -> None:
        step = by_number[number]
        others = [by_number[p]["name"] for p in step["parents"][1:] if p in by_number]
        lines.append(
            f"  {'  ' * depth}{step['name']} [{step['state']}] job {step['job_id']}"
            f" ({step['task']}, attempts {step['attempts']})"
            + (f", also after {', '.join(others)}" if others else "")
            + (", runs anyway" if step["run_anyway"] else "")
            + (f", waiting for {step['pending']}" if step["state"] == "waiting" else "")
        )
        for child in children.get(number, []):
            visit(child, depth + 1)

    for step in steps:
        if not step["parents"]:
            visit(step["step"], 0)
    return lines


def run(args: argparse.Namespace) -> int:
    app = App(args.database_url, schema=args.schema)
    schema = app.schema
    with app.connect(autocommit=True) as conn:
        if args.workflows_command == "list":
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(
                    render(statements.WORKFLOW_LIST, schema),
                    {"state": args.state, "limit": args.limit},
                )
                rows = cur.fetchall()
            if args.json:
                print(json.dumps(rows, default=str))
                return 0
            print(f"{'id':>8}  {'state':<10} {'steps':>11}  {'created':<25} name")
            for row in rows:
                ended = f"{row['steps'] - row['steps_left']}/{row['steps']}"
                print(
                    f"{row['id']:>8}  {row['state']:<10} {ended:>11}  "
                    f"{_time(row['created_at']):<25} {row['name'] or '-'}"
                )
            return 0
        workflow = _one(conn, schema, args.id)
        if args.workflows_command == "show":
            steps = _steps(conn, schema, args.id)
            if args.json:
                print(json.dumps({**workflow, "steps": steps}, indent=2, default=str))
            else:
                print("\n".join(workflow_view(workflow, steps)))
            return 0
        return _cancel(conn, schema, workflow)
    raise AssertionError(args.workflows_command)


def _cancel(conn: psycopg.Connection[Any], schema: str, workflow: dict[str, Any]) -> int:
    if workflow["state"] != "running":
        print(f"workflow {workflow['id']} has ended ({workflow['state']}); nothing to cancel")
        return 1
    params = {"id": workflow["id"]}
    with conn.transaction():
        steps = conn.execute(render(statements.WORKFLOW_LIVE_STEPS, schema), params)
        ended = client.cancel_jobs(conn, schema, [int(r[0]) for r in steps.fetchall()])
        conn.execute(render(statements.WORKFLOW_CANCEL, schema), params)
    print(f"workflow {workflow['id']} cancelled: {ended} steps cancelled or asked to stop")
    return 0
