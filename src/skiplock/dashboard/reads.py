"""What the dashboard shows, read from the database; the decisions about it are pure.

Parsing a page's filters from its query string, merging a page of live jobs with a page of
history, laying out the throughput chart and cleaning a stored traceback are plain
functions with no connection in sight; the functions that take a connection only run the
statements of ``skiplock.sql.dashboard`` and hand the rows to them.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row

from skiplock import types
from skiplock.client.params import tag_json, tags_of
from skiplock.errors import ConfigurationError
from skiplock.sql import dashboard as dashboard_sql
from skiplock.sql import periodic as periodic_sql
from skiplock.sql import render
from skiplock.sql import workflows as workflows_sql
from skiplock.tasks import MAX_QUEUE_NAME, MAX_TAG, check_name

if TYPE_CHECKING:
    from skiplock.app import App

Conn = psycopg.Connection[Any]

LIVE_STATES = types.LIVE_STATES
FINISHED_STATES = ("completed", "cancelled")
STATES = LIVE_STATES + FINISHED_STATES
PAGE_SIZE = 50
# "All matching" acts on at most this many jobs per click (the page says so when reached).
BULK_LIMIT = 10_000


class FilterError(ValueError):
    """A filter in the query string that cannot be used; the message names it."""


@dataclass(frozen=True)
class JobFilter:
    """The jobs page's filters. ``state`` None means every state, live and finished."""

    state: str | None = None
    queue: str | None = None
    task: str | None = None
    args_text: str | None = None
    error_type: str | None = None
    tag: str | None = None
    time_from: datetime | None = None
    time_to: datetime | None = None

    @property
    def reads_live(self) -> bool:
        return self.state is None or self.state in LIVE_STATES

    @property
    def reads_history(self) -> bool:
        return self.state is None or self.state in FINISHED_STATES

    def query(self) -> dict[str, str]:
        """The filter as query-string parameters (the inputs of ``parse_filter``)."""
        values = {
            "state": self.state,
            "queue": self.queue,
            "task": self.task,
            "args": self.args_text,
            "error": self.error_type,
            "tag": self.tag,
            "from": self.time_from.isoformat() if self.time_from else None,
            "to": self.time_to.isoformat() if self.time_to else None,
        }
        return {k: v for k, v in values.items() if v}

    def params(self, *, before: int | None, limit: int) -> dict[str, Any]:
        """Parameters for the statements of skiplock.sql.dashboard."""
        return {
            "state": self.state,
            "queue": self.queue,
            "task": self.task,
            "args_text": f"%{like_escape(self.args_text)}%" if self.args_text else None,
            "error_type": self.error_type,
            "tag": self.tag,
            "tag_json": tag_json(self.tag),
            "time_from": self.time_from,
            "time_to": self.time_to,
            "before": before,
            "limit": limit,
        }


def like_escape(text: str) -> str:
    """``text`` matched literally inside a LIKE pattern (backslash is LIKE's escape)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _time(name: str, text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise FilterError(
            f"{name}={text!r} is not a time: use ISO 8601, e.g. 2026-12-01T15:00"
        ) from None
    # A time without an offset (what <input type="datetime-local"> sends) is read as UTC,
    # the zone every time on the dashboard is shown in.
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def parse_filter(params: Mapping[str, str]) -> JobFilter:
    """The filters of a jobs page from its query string; empty values are no filter."""

    def text(name: str) -> str | None:
        value = params.get(name, "").strip()
        return value or None

    def name(field: str) -> str | None:
        # A queue or task name is matched exactly, spaces included: the overview's link
        # to a queue named " spaced " (written by hand) must find its jobs.
        value = params.get(field, "")
        return value if value.strip() else None

    state = text("state")
    if state is not None and state not in STATES:
        raise FilterError(f"state={state!r} is not a job state: choose one of {', '.join(STATES)}")
    time_from = text("from")
    time_to = text("to")
    tag = text("tag")
    if tag is not None:
        try:
            check_name("tag", tag, MAX_TAG)
        except ConfigurationError as exc:
            raise FilterError(f"tag={tag!r}: {exc}") from None
    return JobFilter(
        state=state,
        queue=name("queue"),
        task=name("task"),
        args_text=text("args"),
        error_type=text("error"),
        tag=tag,
        time_from=_time("from", time_from) if time_from else None,
        time_to=_time("to", time_to) if time_to else None,
    )


def parse_before(text: str | None) -> int | None:
    """The keyset cursor: show jobs with ids below this one."""
    if not text:
        return None
    try:
        before = int(text)
    except ValueError:
        raise FilterError(f"before={text!r} is not a job id") from None
    if before < 1:
        raise FilterError(f"before={text!r} is not a job id")
    return before


@dataclass(frozen=True)
class Page:
    """One page of jobs, newest first; ``next_before`` is the cursor of the next page."""

    jobs: list[dict[str, Any]]
    next_before: int | None


def merge_page(
    live: Sequence[dict[str, Any]], finished: Sequence[dict[str, Any]], size: int
) -> Page:
    """The newest ``size`` of two id-descending lists (each fetched with ``size + 1`` rows),
    and the cursor for the rest. A job is in one table only, so ids never repeat."""
    rows = sorted([*live, *finished], key=lambda row: row["id"], reverse=True)
    if len(rows) > size:
        return Page(rows[:size], rows[size - 1]["id"])
    return Page(rows, None)


def jobs_page(conn: Conn, schema: str, where: JobFilter, before: int | None, size: int) -> Page:
    params = where.params(before=before, limit=size + 1)
    live: list[dict[str, Any]] = []
    finished: list[dict[str, Any]] = []
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        if where.args_text or where.error_type:
            cur.execute(dashboard_sql.JOBS_SCAN_IN_ORDER)
        if where.reads_live:
            live = cur.execute(render(dashboard_sql.JOBS_LIVE_PAGE, schema), params).fetchall()
        if where.reads_history:
            finished = cur.execute(
                render(dashboard_sql.JOBS_HISTORY_PAGE, schema), params
            ).fetchall()
    return merge_page(live, finished, size)


def matching_live_ids(conn: Conn, schema: str, where: JobFilter) -> list[int]:
    """Ids of the live jobs a bulk action on "everything matching" acts on."""
    if not where.reads_live:
        return []
    rows = conn.execute(
        render(dashboard_sql.JOB_IDS_MATCHING, schema),
        where.params(before=None, limit=BULK_LIMIT),
    ).fetchall()
    return [int(row[0]) for row in rows]


# Durable steps shown on a job's page; a job with more says how many it has.
MOST_STEPS_SHOWN = 200


def job_detail(conn: Conn, schema: str, job_id: int) -> dict[str, Any] | None:
    """The job's row, with its durable steps (``steps``, the first MOST_STEPS_SHOWN in
    the order recorded) and how many it has (``step_count``)."""
    with conn.cursor(row_factory=dict_row) as cur:
        job = cur.execute(render(dashboard_sql.JOB_DETAIL, schema), {"id": job_id}).fetchone()
        if job is None:
            return None
        params = {"id": job_id, "limit": MOST_STEPS_SHOWN}
        steps = cur.execute(render(dashboard_sql.JOB_STEPS, schema), params).fetchall()
    job["step_count"] = int(steps[0]["count"]) if steps else 0
    job["steps"] = steps
    return job


def queue_counts(conn: Conn, schema: str) -> list[dict[str, Any]]:
    """Per queue: jobs in each live state, the oldest ready age, workers serving it."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(dashboard_sql.QUEUE_COUNTS, schema)).fetchall()


def queue_last_hour(conn: Conn, schema: str) -> list[dict[str, Any]]:
    """Per queue: jobs completed, cancelled and failed in the last hour."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(dashboard_sql.QUEUE_LAST_HOUR, schema)).fetchall()


# A queue with settings but no jobs (paused while empty) still gets its row.
HOUR_COUNTS = ("completed_hour", "cancelled_hour", "failed_hour")
_NO_JOBS: dict[str, Any] = dict.fromkeys((*LIVE_STATES, "workers", *HOUR_COUNTS), 0) | {
    "oldest_ready_seconds": None
}


def _settable(queue: str) -> bool:
    if queue in (".", ".."):
        return False
    try:
        check_name("queue", queue, MAX_QUEUE_NAME)
    except ConfigurationError:
        return False
    return True


def queue_rows(
    stats: list[dict[str, Any]],
    settings: list[dict[str, Any]],
    hour: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The overview's rows of one database: each queue with jobs, settings or jobs that
    finished in the last hour, its counts, its last hour and its pause and limits; pure."""
    by_queue = {row["queue"]: row for row in stats}
    by_name = {row["name"]: row for row in settings}
    by_hour = {row["queue"]: row for row in hour}
    rows = []
    for name in sorted(set(by_queue) | set(by_name) | set(by_hour)):
        # A queue name skiplock would refuse (written by hand, say with a "/") is shown
        # without actions: pause and limits take only names check_name accepts, and a
        # URL path cannot carry "." or "..".
        settable = _settable(name)
        row: dict[str, Any] = {**_NO_JOBS, "queue": name, **by_queue.get(name, {})}
        for count in HOUR_COUNTS:
            row[count] = int(by_hour.get(name, {}).get(count) or 0)
        setting = by_name.get(name, {})
        row["paused"] = bool(setting.get("paused"))
        row["concurrency_limit"] = setting.get("concurrency_limit")
        row["rate_limit"] = setting.get("rate_limit")
        row["rate_period"] = setting.get("rate_period")
        row["settable"] = settable
        rows.append(row)
    return rows


TOTALLED = (*LIVE_STATES, *HOUR_COUNTS)


def queue_totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The overview's totals row: each count summed over every queue shown; pure."""
    return {name: sum(int(row.get(name) or 0) for row in rows) for name in TOTALLED}


def database_now(conn: Conn, schema: str) -> datetime:
    row = conn.execute(render(dashboard_sql.DASHBOARD_NOW, schema)).fetchone()
    assert row is not None
    moment: datetime = row[0]
    return moment


# -- the throughput chart ----------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One minute: its completed jobs stacked under its cancelled ones (SVG coordinates:
    ``y`` the top of the stack, ``split`` where completed ends)."""

    x: float
    y: float
    split: float
    minute: datetime
    completed: int
    cancelled: int


@dataclass(frozen=True)
class Tick:
    at: float  # x for the time axis, y for the count axis
    label: str


@dataclass(frozen=True)
class Chart:
    """Sixty bars, one per minute, in a plot area of ``plot_width`` x ``plot_height`` whose
    top left corner is (``left``, ``top``), a count axis on the left and a time axis
    (UTC) below, in an SVG box of ``width`` x ``height``."""

    bars: list[Bar]
    peak: int
    total: int
    completed: int
    cancelled: int
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    left: int = 44
    top: int = 8
    plot_width: int = 600
    plot_height: int = 120
    bar_width: float = 9.0

    @property
    def width(self) -> int:
        return self.left + self.plot_width + 8

    @property
    def height(self) -> int:
        return self.top + self.plot_height + 26

    @property
    def bottom(self) -> int:
        return self.top + self.plot_height


def _count_ticks(peak: int) -> list[int]:
    """Round counts from 0 to the first at or above ``peak``, 1, 2 or 5 times a power of
    ten apart, at most five of them: 0, 5, 10, 15 for a peak of 12."""
    if peak <= 0:
        return [0]
    magnitude = 1
    while True:
        for step in (magnitude, 2 * magnitude, 5 * magnitude):
            if peak <= 4 * step:
                top = -(-peak // step) * step
                return list(range(0, top + 1, step))
        magnitude *= 10


def throughput_chart(rows: Sequence[Mapping[str, Any]], now: datetime) -> Chart:
    """Lay out finished jobs per minute for the hour up to ``now``: bars, a count axis
    with round ticks and a time axis marked every ten minutes (UTC); pure."""
    end = now.astimezone(UTC).replace(second=0, microsecond=0)
    minutes = [end - timedelta(minutes=59 - n) for n in range(60)]
    completed = dict.fromkeys(minutes, 0)
    cancelled = dict.fromkeys(minutes, 0)
    for row in rows:
        minute = row["minute"].astimezone(UTC)
        if minute in completed:
            target = completed if row["state"] == "completed" else cancelled
            target[minute] += int(row["jobs"])
    peak = max([completed[m] + cancelled[m] for m in minutes] + [0])
    counts = _count_ticks(peak)
    scale_top = counts[-1]
    chart = Chart(
        bars=[],
        peak=peak,
        total=sum(completed.values()) + sum(cancelled.values()),
        completed=sum(completed.values()),
        cancelled=sum(cancelled.values()),
        y_ticks=[],
        x_ticks=[],
    )

    def y(count: int) -> float:
        return round(chart.bottom - (count / scale_top * chart.plot_height if scale_top else 0), 1)

    bars = []
    x_ticks = []
    for n, minute in enumerate(minutes):
        x = chart.left + n * 10.0
        done, gone = completed[minute], cancelled[minute]
        bars.append(Bar(x, y(done + gone), y(done), minute, done, gone))
        if minute.minute % 10 == 0:
            x_ticks.append(Tick(x + chart.bar_width / 2, minute.strftime("%H:%M")))
    y_ticks = [Tick(y(count), str(count)) for count in counts]
    return replace(chart, bars=bars, x_ticks=x_ticks, y_ticks=y_ticks)


def throughput_rows(conn: Conn, schema: str) -> list[dict[str, Any]]:
    """Jobs finished per minute and outcome over the last hour (throughput_chart lays
    them out; the rows of several databases add up)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(render(dashboard_sql.THROUGHPUT_LAST_HOUR, schema)).fetchall()


# -- cron --------------------------------------------------------------------------------


def cron_rows(conn: Conn, schema: str, app: App | None, now: datetime) -> list[dict[str, Any]]:
    """Each schedule: as the App given defines it, else as the workers that tick it
    described it (migration 0030); its last tick, next tick, and whether it is paused."""
    with conn.cursor(row_factory=dict_row) as cur:
        stored = {
            row["name"]: row
            for row in cur.execute(render(periodic_sql.PERIODIC_LIST, schema)).fetchall()
        }
    rows: list[dict[str, Any]] = []
    names = sorted(set(stored) | set(app.periodics if app else ()))
    for name in names:
        entry = app.periodics.get(name) if app else None
        row = stored.get(name, {})
        last_tick = row.get("last_tick")
        next_fire = row.get("next_tick")
        if entry is not None:
            # A last tick written by hand past year 9999 has no next fire to show.
            with contextlib.suppress(OverflowError, ValueError):
                next_fire = entry.schedule.next_after(max(now, last_tick or now))
        rows.append(
            {
                "name": name,
                "expression": entry.schedule.expression if entry else row.get("expression"),
                "queue": entry.task.options.queue if entry else row.get("queue"),
                "missed": entry.missed if entry else row.get("missed"),
                "last_tick": last_tick,
                "next_fire": next_fire,
                "registered": entry is not None,
                "recorded": name in stored,
                "paused": bool(row.get("paused")),
            }
        )
    return rows


# -- errors ------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A stored field as text: text as it is, anything else as its JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (RecursionError, ValueError):
        return "(nested too deep to show)"


def error_entries(errors: Any) -> list[dict[str, Any]]:
    """Each recorded failure as the job page shows it, whatever was stored: skiplock
    writes a list of objects with attempt, at, type, message and traceback, but a row
    written by hand may hold any JSON. A missing field shows as "?", a field that is not
    text as its JSON, an entry that is not an object as its JSON in the message; pure."""
    if errors is None:
        return []
    entries = errors if isinstance(errors, list) else [errors]
    shown = []
    for entry in entries:
        fields = entry if isinstance(entry, dict) else {"message": _shown(entry) or "null"}
        traceback = fields.get("traceback")
        shown.append(
            {
                "attempt": _shown(fields.get("attempt")) or "?",
                "at": _shown(fields.get("at")) or "?",
                "at_time": moment(fields.get("at")),
                "worker": _shown(fields.get("worker")),
                "claimed_at": moment(fields.get("claimed_at")),
                "type": _shown(fields.get("type")) or "?",
                "message": _shown(fields.get("message")),
                "lines": traceback_lines(
                    traceback if isinstance(traceback, str) else _pretty_json(traceback)
                ),
            }
        )
    return shown


def moment(value: Any) -> datetime | None:
    """A time stored as ISO 8601 text in a JSON record (UTC when it names no zone), or
    None when it is not one; pure."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _pretty_json(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return json.dumps(value, indent=2, default=str, ensure_ascii=False)
    except (RecursionError, ValueError):
        return "(nested too deep to show)"


def job_tags(value: Any) -> list[str]:
    """The tags of a row: its ``tags`` (a JSON array), or its meta's; only the strings in
    it, whatever else a row written by hand holds; pure."""
    return list(tags_of(value.get("tags") if isinstance(value, dict) else value))


def last_error_type(errors: Any) -> str:
    """The class name of the last failure recorded, for the jobs list ("" when none,
    "?" when the entry names none); pure."""
    entries = error_entries(errors)
    return entries[-1]["type"] if entries else ""


# -- tracebacks --------------------------------------------------------------------------

# Frames of skiplock's own machinery and of asyncio that sit above every handler's code.
_MACHINERY = ("/skiplock/executor.py", "/skiplock/worker/", "/asyncio/", "/concurrent/futures/")


def traceback_lines(text: str | None) -> list[tuple[str, bool]]:
    """A stored traceback as (line, is machinery) pairs, so the page can dim the frames of
    skiplock and asyncio and the handler's own frames stand out; pure."""
    if not text:
        return []
    lines = text.rstrip("\n").split("\n")
    marked: list[tuple[str, bool]] = []
    machinery = False
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith('File "'):
            machinery = any(part in stripped for part in _MACHINERY)
        elif not line.startswith(" "):
            machinery = False  # "Traceback ..." and the final "Type: message" line
        marked.append((line, machinery))
    return marked


# -- the timeline of one job ---------------------------------------------------------------


def _by(worker: Any) -> str:
    return f" by worker {str(worker)[:8]}" if worker else ""


def timeline(job: Mapping[str, Any]) -> list[tuple[datetime, str]]:
    """Enqueued, each attempt's claim (and worker) and end, the last attempt's claim, each
    durable step recorded, a wait for a signal, and the end, in time order; pure."""
    events: list[tuple[datetime, str]] = [(job["created_at"], "enqueued")]
    if job.get("run_at") and job["run_at"] > job["created_at"]:
        events.append((job["run_at"], "due"))
    for error in error_entries(job.get("errors")):
        attempt = error["attempt"]
        if error["claimed_at"] is not None:
            events.append((error["claimed_at"], f"attempt {attempt} claimed{_by(error['worker'])}"))
        if error["at_time"] is not None:  # else the error still shows below
            events.append((error["at_time"], f"attempt {attempt} failed: {error['type']}"))
    claimed = {event for event, what in events if " claimed" in what}
    if job.get("attempted_at") and job["attempted_at"] not in claimed:
        workers = job.get("worker_ids") or []
        worker = job.get("worker_id") or (workers[-1] if workers else None)
        events.append((job["attempted_at"], f"attempt {job['attempts']} claimed{_by(worker)}"))
    if job.get("retry_at") and job["state"] == "retryable":
        events.append((job["retry_at"], "retry due"))
    if job.get("cancel_requested_at"):
        events.append((job["cancel_requested_at"], "cancel requested"))
    for step in job.get("steps") or ():
        events.append(
            (step["done_at"], f"step {step['name']!r} recorded, attempt {step['attempt']}")
        )
    if job.get("wait_key"):
        events.append((job["run_at"], f"waits for signal {job['wait_key']!r}"))
    if job.get("finished_at"):
        events.append((job["finished_at"], str(job["state"])))
    events.sort(key=lambda event: event[0])
    return events


def durations(job: Mapping[str, Any], now: datetime) -> tuple[float | None, float | None]:
    """(waited, ran) in seconds, None where not known (yet). Waited: from when the job was
    due (its run time when later than its enqueue; history keeps only the enqueue) to its
    first start. Ran: its last attempt, from its claim to its end (finished, or failed),
    or to ``now`` while it runs; pure."""
    due = job["created_at"]
    started = job.get("started_at")
    run_at = job.get("run_at")
    # A run time past the first start was set since (a snooze, a retry by hand): the
    # wait counts from the enqueue.
    if run_at is not None and due < run_at and (started is None or run_at <= started):
        due = run_at
    waited = max(0.0, (started - due).total_seconds()) if started is not None else None
    claimed = job.get("attempted_at")
    end = job.get("finished_at")
    if end is None and job.get("state") == "running":
        end = now
    elif end is None and job.get("state") in ("dead", "retryable"):
        failures = error_entries(job.get("errors"))
        end = failures[-1]["at_time"] if failures else None
    ran = (end - claimed).total_seconds() if claimed is not None and end is not None else None
    return waited, (max(0.0, ran) if ran is not None else None)


def progress_fraction(progress: Any) -> float | None:
    """How far a job's progress says it is, from 0 to 1, when it says so in a form the
    page can draw: {"done": n, "of": m} (or "current"/"total"), {"percent": p}, or a
    number from 0 to 1. None for anything else (the value is still shown); pure."""

    def number(value: Any) -> float | None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok and math.isfinite(value) else None

    fraction: float | None = None
    if isinstance(progress, dict):
        for done_key, total_key in (("done", "of"), ("current", "total")):
            done, total = number(progress.get(done_key)), number(progress.get(total_key))
            if done is not None and total is not None and total > 0:
                fraction = done / total
                break
        else:
            percent = number(progress.get("percent"))
            fraction = percent / 100 if percent is not None else None
    else:
        value = number(progress)
        fraction = value if value is not None and 0 <= value <= 1 else None
    return None if fraction is None else min(1.0, max(0.0, fraction))


# -- workflows ----------------------------------------------------------------------------

# A graph past this many steps is not drawn (the steps are still listed): boxes that small
# say nothing, and the page would weigh megabytes.
GRAPH_MOST_STEPS = 300
WORKFLOWS_PAGE = 50


@dataclass(frozen=True)
class GraphNode:
    number: int
    name: str
    state: str
    job_id: int
    x: int
    y: int


@dataclass(frozen=True)
class Graph:
    """A workflow's steps as boxes in columns by depth (a step one column right of its
    deepest parent), and its edges as lines from a parent's right to a child's left, in
    SVG coordinates."""

    nodes: list[GraphNode]
    edges: list[tuple[int, int, int, int]]
    width: int
    height: int
    node_width: int = 150
    node_height: int = 26


def workflow_graph(steps: Sequence[Mapping[str, Any]]) -> Graph | None:
    """Lay out a workflow's steps (rows of WORKFLOW_STEPS); pure. None past
    GRAPH_MOST_STEPS. A parent not among the steps (a row written by hand) is left out."""
    if not steps or len(steps) > GRAPH_MOST_STEPS:
        return None
    by_number = {int(s["step"]): s for s in steps}
    depth: dict[int, int] = {}
    for number in sorted(by_number):  # a step's parents were added before it
        parents = [int(p) for p in by_number[number]["parents"] or () if int(p) in depth]
        depth[number] = 1 + max((depth[p] for p in parents), default=-1)
    shape = Graph([], [], 0, 0)
    step_x, step_y = shape.node_width + 50, shape.node_height + 12
    rows: dict[int, int] = {}
    place: dict[int, tuple[int, int]] = {}
    nodes = []
    for number in sorted(by_number):
        column = depth[number]
        row = rows.get(column, 0)
        rows[column] = row + 1
        x, y = 10 + column * step_x, 10 + row * step_y
        place[number] = (x, y)
        step = by_number[number]
        nodes.append(
            GraphNode(
                number, str(step["name"]), str(step["state"] or "?"), int(step["job_id"]), x, y
            )
        )
    middle = shape.node_height // 2
    edges = [
        (place[p][0] + shape.node_width, place[p][1] + middle, x, y + middle)
        for number, (x, y) in place.items()
        for p in (int(p) for p in by_number[number]["parents"] or ())
        if p in place
    ]
    width = 20 + (max(depth.values()) + 1) * step_x - 50
    height = 20 + max(rows.values()) * step_y - 12
    return replace(shape, nodes=nodes, edges=edges, width=width, height=height)


def workflow_list(conn: Conn, schema: str, state: str | None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        query = render(workflows_sql.WORKFLOW_LIST, schema)
        return cur.execute(query, {"state": state, "limit": WORKFLOWS_PAGE}).fetchall()


def workflow_detail(
    conn: Conn, schema: str, workflow_id: int
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """A workflow and its steps, each with its job's state (live or from history)."""
    with conn.cursor(row_factory=dict_row) as cur:
        params = {"id": workflow_id}
        workflow = cur.execute(render(workflows_sql.WORKFLOW_GET, schema), params).fetchone()
        if workflow is None:
            return None, []
        steps = cur.execute(render(workflows_sql.WORKFLOW_STEPS, schema), params).fetchall()
    return workflow, steps
