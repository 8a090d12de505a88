"""The dashboard as an ASGI application (Starlette routes, Jinja2 pages).

Every page is a plain GET; its live part is re-fetched with ``?fragment=1`` by the page's
script and swapped in, so nothing but a small vendored script runs in the browser. Every
change is a POST through skiplock.Admin, as the CLI's are (``retry_jobs``,
``pause_queue``, ...), guarded by the checks of ``security`` and logged.

Database work is synchronous psycopg on small pools, run in Starlette's thread pool. The
pools open on first use, not at startup: mounted inside another application, this app's
lifespan never runs. Each database shown (one, or every database of an App with routes,
``?db=N``: see databases.py) has its own; with a read URL, every page reads through a
read-only pool on the replica and says how far behind it is, and every action writes
through the primary's.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode

import jinja2
import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from skiplock.admin import Admin
from skiplock.app import App
from skiplock.config import DEFAULT_SCHEMA, validate_schema
from skiplock.dashboard import reads, security, values
from skiplock.dashboard.databases import DB_PARAM, Database, dashboard_databases, pick_database
from skiplock.errors import ConfigurationError, JobNotFoundError, ScheduleNotFoundError
from skiplock.replica import ReplicaState, replica_state
from skiplock.routing import describe_url, without_passwords
from skiplock.sql import dashboard as dashboard_sql
from skiplock.sql import render
from skiplock.tasks import MAX_QUEUE_NAME, check_name, parse_rate
from skiplock.types import WORKFLOW_STATES
from skiplock.wording import plural

log = logging.getLogger("skiplock.dashboard")
T = TypeVar("T")

_HERE = Path(__file__).parent
NOTICE_COOKIE = "skiplock_notice"
# Reads that take longer are cancelled: a text search over a large history should fail
# with advice (narrow the time range), not hold a connection for minutes.
STATEMENT_TIMEOUT_MS = 15_000
# How long a page waits for a connection before it says the database cannot be reached,
# and how long each connection attempt may take (a host that is down would otherwise hold
# it for the kernel's SYN retries).
CONNECTION_WAIT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 5
REFRESH_SECONDS = 3.0
JOB_ACTIONS = ("retry", "cancel", "delete")
# After an action, the page the browser returns to is read from the replica at once, which
# may not have replayed the change yet (docs/dashboard.md, "Reading from a replica").
REPLICA_AFTER_CHANGE = (
    "Made on the primary, it shows here once the replica has replayed it (this page reads "
    "the replica and refreshes by itself)."
)
_BULK = {
    "retry": (Admin.retry_jobs, "made available again"),
    "cancel": (Admin.cancel_jobs, "cancelled (running ones asked to stop)"),
    "delete": (Admin.delete_jobs, "deleted"),
}
_SINGLE = {"retry": Admin.retry_job, "cancel": Admin.cancel_job, "delete": Admin.delete_job}
_CRON: dict[str, Callable[[Admin, str], object]] = {
    "pause": Admin.pause_schedule,
    "resume": Admin.resume_schedule,
    "run-now": Admin.run_schedule_now,
}


class ForbiddenError(Exception):
    """A request refused for a reason the person should read (read-only, CSRF, origin)."""


class SignInRequiredError(ForbiddenError):
    """A token is configured and the request does not carry it."""


def _environment() -> jinja2.Environment:
    # autoescape on for every template: a job's arguments are text, never markup.
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    environment.filters["when"] = _when
    environment.filters["seconds"] = _seconds
    environment.filters["pretty"] = _pretty
    environment.filters["compact"] = _compact
    environment.filters["last_error_type"] = reads.last_error_type
    environment.filters["job_tags"] = reads.job_tags
    environment.filters["durations"] = reads.durations
    environment.filters["progress_fraction"] = reads.progress_fraction
    return environment


def _when(value: datetime | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, values.FarTime):
        return value.text
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "∞" if value > 0 else "-∞"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def _pretty(value: Any) -> str:
    if isinstance(value, values.RawJson):
        return str(value)
    try:
        return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)
    except (RecursionError, ValueError):
        return _compact(value, limit=None)


def _compact(value: Any, limit: int | None = 120) -> str:
    if isinstance(value, values.RawJson):
        text = str(value)
    else:
        try:
            text = json.dumps(value, default=str, ensure_ascii=False)
        except (RecursionError, ValueError):
            text = "(nested too deep to show)"
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


class DatabaseUnreachableError(Exception):
    """A database (or the replica the pages read) cannot be reached; the message names it,
    never with its password, and says why."""


class Dashboard:
    """The state behind the routes: the databases, their pools, the settings."""

    def __init__(
        self,
        databases: list[Database],
        schema: str,
        *,
        read_only: bool,
        token: str | None,
        app: App | None,
        refresh_seconds: float,
        allowed_hosts: frozenset[str] = frozenset(),
    ) -> None:
        self.databases = databases
        self.allowed_hosts = allowed_hosts
        self.schema = validate_schema(schema)
        self.read_only = read_only
        self.token = token or None
        self.app = app
        self.refresh_seconds = refresh_seconds
        self.templates = _environment()
        # One pool per (URL, read-only): a replica's pool is opened read-only, so that no
        # statement of the dashboard can write there even if the URL is a primary.
        self._pools: dict[tuple[str, bool], ConnectionPool[psycopg.Connection[Any]]] = {}
        self._pool_lock = threading.Lock()
        # What each database's Admin is built from: its URL and the schema, no routes
        # (a request names its database, or pick_database finds its queue's).
        self._apps = {d.url: App(d.url, schema=self.schema) for d in databases}

    @property
    def several(self) -> bool:
        return len(self.databases) > 1

    @property
    def reads_replica(self) -> bool:
        return self.databases[0].read_url is not None

    def pool(self, url: str, *, read_only: bool) -> ConnectionPool[psycopg.Connection[Any]]:
        with self._pool_lock:
            pool = self._pools.get((url, read_only))
            if pool is None:
                settings = f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"
                if read_only:
                    settings += " -c default_transaction_read_only=on"
                pool = self._pools[(url, read_only)] = ConnectionPool(
                    url,
                    min_size=1,
                    max_size=4,
                    open=True,
                    timeout=CONNECTION_WAIT_SECONDS,
                    # Each connection is checked as it leaves the pool: after a restart of
                    # the server (a replica's, say), the next page gets a live one.
                    check=ConnectionPool.check_connection,
                    # No server-side prepared statements: each statement is planned with
                    # its values (see skiplock.sql.dashboard).
                    kwargs={
                        "autocommit": True,
                        "prepare_threshold": None,
                        "options": settings,
                        "application_name": "skiplock dashboard",
                        "connect_timeout": CONNECT_TIMEOUT_SECONDS,
                    },
                )
            return pool

    def close(self) -> None:
        with self._pool_lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    @contextmanager
    def _connection(
        self, url: str, *, read_only: bool, what: str
    ) -> Iterator[psycopg.Connection[Any]]:
        """A connection from ``url``'s pool. A pool that found no connection in time, or a
        connection that broke, becomes DatabaseUnreachableError naming ``what`` and the
        reason (a direct attempt tells it)."""
        try:
            with self.pool(url, read_only=read_only).connection() as conn:
                yield conn
        except (PoolTimeout, psycopg.OperationalError) as exc:
            # A server that answered with a SQLSTATE (a cancelled query, a conflict with
            # recovery) is reachable; only connection errors (08) and a server going
            # down or starting (57P) are not.
            if exc.sqlstate is not None and not exc.sqlstate.startswith(("08", "57P")):
                raise
            reason = _why_unreachable(url)
            raise DatabaseUnreachableError(f"cannot reach {what}: {reason}") from None

    def read(
        self, database: Database, work: Callable[[psycopg.Connection[Any]], T]
    ) -> tuple[T, ReplicaState | None]:
        """``work`` on the connection every page reads (the replica's, when given), and
        how far behind that replica is."""
        # A value Python cannot load (JSON too deep, a timestamp past 9999) is read again
        # as its text instead of failing the page (values.py).
        if database.read_url is None:
            what = f"the database {database.label}"
            with self._connection(database.url, read_only=False, what=what) as conn:
                return values.read_tolerantly(conn, work), None
        what = f"the read URL (the replica) {describe_url(database.read_url)}"
        with self._connection(database.read_url, read_only=True, what=what) as conn:
            state = replica_state(conn)
            return values.read_tolerantly(conn, work), state

    def admin(self, database: Database, conn: psycopg.Connection[Any]) -> Admin:
        """The admin operations of ``database`` on ``conn`` (its read or its change
        connection)."""
        return Admin(self._apps[database.url], conn)

    def change(self, database: Database, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``work`` in one transaction on the primary, as the CLI runs its changes."""
        what = f"the database {database.label}"
        with (
            self._connection(database.url, read_only=False, what=what) as conn,
            conn.transaction(),
        ):
            return work(conn)

    def app_for(self, database: Database) -> App | None:
        """The App as it stands on ``database``: its periodic tasks are those whose queue
        lives there."""
        if self.app is None or not self.several:
            return self.app
        return self.app._for_database(database.url)


def _why_unreachable(url: str) -> str:
    """What a direct connection attempt says, without the URL's password (libpq's and
    psycopg's messages quote a malformed URL's bad token, or a password's tail taken for
    the host: routing.without_passwords)."""
    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_SECONDS, autocommit=True):
            pass
    except psycopg.Error as exc:
        return without_passwords(str(exc).strip(), url)
    return (
        f"no connection was free within {CONNECTION_WAIT_SECONDS:g} s (every one busy with a "
        "slow read): try again"
    )


# -- requests ------------------------------------------------------------------------


def _prefix(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _route_path(request: Request) -> str:
    """The request's path below the dashboard's prefix, with its query."""
    path = request.url.path
    prefix = _prefix(request)
    if prefix and path.startswith(prefix):
        path = path[len(prefix) :] or "/"
    query = [(k, v) for k, v in request.query_params.multi_items() if k != "fragment"]
    return path + ("?" + urlencode(query) if query else "")


def _safe_next(value: str | None) -> str:
    """A redirect target below the prefix: a path, never another site (no // or scheme)."""
    if not value or not value.startswith("/") or "\\" in value:
        return "/"
    # Browsers drop tabs and line breaks inside a URL: "/\t/evil.example" would become
    # "//evil.example", another site.
    if any(ord(char) < 0x21 or ord(char) == 0x7F for char in value) or value.startswith("//"):
        return "/"
    return value


def _who(request: Request, dashboard: Dashboard) -> str:
    host = request.client.host if request.client else "?"
    return f"{host} ({'token' if dashboard.token else 'no token'})"


async def _form(request: Request) -> dict[str, list[str]]:
    """The url-encoded body (parsed here: no multipart library needed)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    fields: dict[str, list[str]] = {}
    for key, value in parse_qsl(body, keep_blank_values=True):
        fields.setdefault(key, []).append(value)
    return fields


def _first(fields: Mapping[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    return values[0] if values else None


class Pages:
    """The route handlers, bound to one Dashboard."""

    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.router: Starlette | None = None

    # -- rendering ---------------------------------------------------------------------

    def url(self, request: Request, name: str, /, **params: Any) -> str:
        assert self.router is not None
        return _prefix(request) + str(self.router.url_path_for(name, **params))

    def link(
        self,
        request: Request,
        name: str,
        /,
        query: Mapping[str, Any] | None = None,
        *,
        db: int | None = None,
        **params: Any,
    ) -> str:
        """The URL of a page or action with its query; with several databases it names
        the database (``db=N``) too, so that a job id reaches the job it means."""
        values = {k: v for k, v in (query or {}).items() if v is not None and v != ""}
        if db is not None and self.dashboard.several:
            values = {DB_PARAM: db, **values}
        url = self.url(request, name, **params)
        return url + ("?" + urlencode(values) if values else "")

    def database(self, request: Request, *, queue: str | None = None) -> Database:
        """The database a request is about (``?db=N``; see databases.pick_database)."""
        return pick_database(
            self.dashboard.databases, request.query_params, queue=queue, app=self.dashboard.app
        )

    async def read(
        self, request: Request, database: Database, work: Callable[[psycopg.Connection[Any]], T]
    ) -> T:
        """``work`` on the database's read connection, in the thread pool; how far behind
        the replica is goes to the page (render)."""
        result, state = await run_in_threadpool(self.dashboard.read, database, work)
        if state is not None:
            request.state.replica = state
        return result

    def render(
        self,
        request: Request,
        template: str,
        body: str,
        context: dict[str, Any],
        *,
        status: int = 200,
    ) -> Response:
        """The page, or only its live part when the page's script asks (``fragment``)."""
        dashboard = self.dashboard
        csrf = request.cookies.get(security.CSRF_COOKIE) or security.new_csrf_token()
        notice = request.cookies.get(NOTICE_COOKIE)
        base = {
            "request": request,
            "url": lambda name, **params: self.url(request, name, **params),
            "link": lambda name, query=None, **params: self.link(request, name, query, **params),
            "static": lambda path: self.url(request, "static", path=path),
            "prefix": _prefix(request),
            "here": _route_path(request),
            "read_only": dashboard.read_only,
            "csrf_field": security.CSRF_FIELD,
            "csrf": csrf,
            "body": body,
            "refresh_ms": int(dashboard.refresh_seconds * 1000),
            "notice": notice,
            "schema": dashboard.schema,
            "several": dashboard.several,
            "databases": dashboard.databases,
            "replica": getattr(request.state, "replica", None),
        }
        fragment = request.query_params.get("fragment") == "1"
        name = "live.html" if fragment else template
        html = dashboard.templates.get_template(name).render({**base, **context})
        response = HTMLResponse(html, status_code=status)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["X-Frame-Options"] = "DENY"
        # Scripts and styles only from the dashboard itself: an argument that slipped
        # through escaping still could not run.
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "frame-ancestors 'none'; form-action 'self'"
        )
        if security.CSRF_COOKIE not in request.cookies:
            response.set_cookie(
                security.CSRF_COOKIE,
                csrf,
                httponly=True,
                samesite="strict",
                path=_prefix(request) or "/",
            )
        if notice and not fragment:
            response.delete_cookie(NOTICE_COOKIE, path=_prefix(request) or "/")
        return response

    def error(self, request: Request, status: int, message: str) -> Response:
        return self.render(
            request, "error.html", "error_body.html", {"message": message}, status=status
        )

    def back(
        self, request: Request, target: str | None, notice: str, *, changed: bool = False
    ) -> Response:
        """Back to the page the action came from, with ``notice`` shown once. After a
        change, a dashboard that reads a replica says that the page shows it only once the
        replica has replayed it: the redirect's page is read there at once."""
        notice = notice[:300]
        if changed and self.dashboard.reads_replica:
            notice += f". {REPLICA_AFTER_CHANGE}"
        response = RedirectResponse(_prefix(request) + _safe_next(target), status_code=303)
        response.set_cookie(
            NOTICE_COOKIE, notice, httponly=True, samesite="strict", path=_prefix(request) or "/"
        )
        return response

    # -- guards ------------------------------------------------------------------------

    def check_read(self, request: Request) -> None:
        if not security.authorized(
            self.dashboard.token,
            header=request.headers.get("authorization"),
            cookie=request.cookies.get(security.AUTH_COOKIE),
        ):
            raise SignInRequiredError("sign in first: this dashboard needs its token")

    async def check_change(self, request: Request) -> dict[str, list[str]]:
        """The guards of every action; returns its form."""
        if self.dashboard.read_only:
            raise ForbiddenError("this dashboard is read-only: actions are turned off")
        self.check_read(request)
        refusal = security.origin_refusal(
            request.headers.get("origin"),
            [request.headers.get("host"), request.headers.get("x-forwarded-host")],
            self.dashboard.allowed_hosts,
        )
        if refusal is not None:
            raise ForbiddenError(refusal)
        fields = await _form(request)
        if not security.same_token(
            _first(fields, security.CSRF_FIELD), request.cookies.get(security.CSRF_COOKIE)
        ):
            raise ForbiddenError(
                "refused: the form's CSRF token is missing or stale; reload the page and try again"
            )
        return fields

    async def guarded(
        self, request: Request, handler: Callable[[Request], Any], *, change: bool
    ) -> Response:
        try:
            if change:
                request.state.fields = await self.check_change(request)
            else:
                self.check_read(request)
            response: Response = await handler(request)
            return response
        except ForbiddenError as exc:
            if isinstance(exc, SignInRequiredError) and not change:
                return RedirectResponse(
                    self.url(request, "login") + "?" + urlencode({"next": _route_path(request)}),
                    status_code=303,
                )
            log.warning(
                "dashboard refused %s %s from %s: %s",
                request.method,
                request.url.path,
                _who(request, self.dashboard),
                exc,
            )
            return self.error(request, 403, str(exc))
        except reads.FilterError as exc:
            return self.error(request, 400, str(exc))
        except ConfigurationError as exc:
            return self.error(request, 400, str(exc))
        except DatabaseUnreachableError as exc:
            return self.error(request, 503, f"{exc} (the page works again once it can be reached)")
        except psycopg.errors.SerializationFailure as exc:
            # A standby cancels a read that holds back its replay (a conflict with
            # recovery); the next read usually goes through.
            return self.error(
                request, 503, f"the read was cancelled ({str(exc).strip()}): reload the page"
            )
        except psycopg.errors.QueryCanceled:
            return self.error(
                request,
                503,
                "the query took too long and was cancelled: narrow the filter "
                "(a queue, a task or a time range) and try again",
            )
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as exc:
            return self.error(
                request,
                503,
                f"schema {self.dashboard.schema!r} is not set up ({str(exc).strip()}): "
                "run `skiplock migrate`",
            )

    # -- pages -------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        """Every database's queues and workers (in the App's databases() order), and the
        jobs finished per minute over all of them."""
        dashboard = self.dashboard
        schema = dashboard.schema
        queues: list[dict[str, Any]] = []
        workers: list[dict[str, Any]] = []
        finished: list[dict[str, Any]] = []
        now: datetime | None = None

        def reading(database: Database) -> Callable[[psycopg.Connection[Any]], dict[str, Any]]:
            def work(conn: psycopg.Connection[Any]) -> dict[str, Any]:
                admin = dashboard.admin(database, conn)
                return {
                    "now": reads.database_now(conn, schema),
                    "stats": reads.queue_counts(conn, schema),
                    "hour": reads.queue_last_hour(conn, schema),
                    "settings": admin.queue_settings(),
                    "busy": dict(conn.execute(render(dashboard_sql.WORKER_BUSY, schema))),
                    "workers": admin.workers(),
                    "finished": reads.throughput_rows(conn, schema),
                }

            return work

        for database in dashboard.databases:
            found = await self.read(request, database, reading(database))
            now = now or found["now"]
            where = {"db": database.index, "database": database.label}
            rows = reads.queue_rows(found["stats"], found["settings"], found["hour"])
            queues += [{**row, **where} for row in rows]
            for worker in found["workers"]:
                workers.append({**worker, **where, "busy": found["busy"].get(worker["id"], 0)})
            finished += found["finished"]
        assert now is not None
        context = {
            "now": now,
            "queues": queues,
            "workers": workers,
            "chart": reads.throughput_chart(finished, now),
            "totals": reads.queue_totals(queues),
        }
        return self.render(request, "overview.html", "overview_body.html", context)

    async def jobs(self, request: Request) -> Response:
        dashboard = self.dashboard
        where = reads.parse_filter(request.query_params)
        before = reads.parse_before(request.query_params.get("before"))
        database = self.database(request, queue=where.queue)

        def work(conn: psycopg.Connection[Any]) -> tuple[reads.Page, datetime]:
            return (
                reads.jobs_page(conn, dashboard.schema, where, before, reads.PAGE_SIZE),
                reads.database_now(conn, dashboard.schema),
            )

        page, now = await self.read(request, database, work)
        query = where.query()
        next_url = (
            self.link(request, "jobs", {**query, "before": page.next_before}, db=database.index)
            if page.next_before
            else None
        )
        first_url = self.link(request, "jobs", query, db=database.index) if before else None
        return self.render(
            request,
            "jobs.html",
            "jobs_body.html",
            {
                "where": where,
                "filter_fields": query,
                "page": page,
                "states": reads.STATES,
                "next_url": next_url,
                "first_url": first_url,
                "bulk_limit": reads.BULK_LIMIT,
                "database": database,
                "now": now,
            },
        )

    async def job(self, request: Request) -> Response:
        dashboard = self.dashboard
        job_id = int(request.path_params["job_id"])
        database = self.database(request)

        def work(conn: psycopg.Connection[Any]) -> tuple[dict[str, Any] | None, datetime]:
            return (
                reads.job_detail(conn, dashboard.schema, job_id),
                reads.database_now(conn, dashboard.schema),
            )

        job, now = await self.read(request, database, work)
        if job is None:
            return self.error(request, 404, self.no_such_job(job_id, database))
        errors = reads.error_entries(job["errors"])
        return self.render(
            request,
            "job.html",
            "job_body.html",
            {
                "job": job,
                "errors": errors,
                "timeline": reads.timeline(job),
                "now": now,
                "database": database,
            },
        )

    async def workflows(self, request: Request) -> Response:
        dashboard = self.dashboard
        state = request.query_params.get("state") or None
        if state is not None and state not in WORKFLOW_STATES:
            known = ", ".join(WORKFLOW_STATES)
            return self.error(request, 400, f"unknown workflow state {state!r} (one of {known})")
        rows: list[dict[str, Any]] = []
        for database in dashboard.databases:
            found = await self.read(
                request, database, lambda conn: reads.workflow_list(conn, dashboard.schema, state)
            )
            rows += [{**row, "db": database.index} for row in found]
        return self.render(
            request,
            "workflows.html",
            "workflows_body.html",
            {"workflows": rows, "state": state, "states": WORKFLOW_STATES},
        )

    async def workflow(self, request: Request) -> Response:
        dashboard = self.dashboard
        workflow_id = int(request.path_params["workflow_id"])
        database = self.database(request)
        workflow, steps = await self.read(
            request,
            database,
            lambda conn: reads.workflow_detail(conn, dashboard.schema, workflow_id),
        )
        if workflow is None:
            return self.error(request, 404, f"no workflow with id {workflow_id}")
        return self.render(
            request,
            "workflow.html",
            "workflow_body.html",
            {
                "workflow": workflow,
                "steps": steps,
                "names": {int(s["step"]): s["name"] for s in steps},
                "graph": reads.workflow_graph(steps),
                "graph_most": reads.GRAPH_MOST_STEPS,
                "database": database,
            },
        )

    def no_such_job(self, job_id: int, database: Database) -> str:
        message = f"no job with id {job_id} (live or in history)"
        if not self.dashboard.several:
            return message
        others = ", ".join(
            f"db={d.index} ({d.label})" for d in self.dashboard.databases if d != database
        )
        return (
            f"{message} on database {database.label}: job ids are per database; "
            f"the others are {others}"
        )

    async def cron(self, request: Request) -> Response:
        dashboard = self.dashboard
        rows: list[dict[str, Any]] = []

        def schedules(bound: App | None) -> Callable[[psycopg.Connection[Any]], Any]:
            def work(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
                now = reads.database_now(conn, dashboard.schema)
                return reads.cron_rows(conn, dashboard.schema, bound, now)

            return work

        for database in dashboard.databases:
            # Each database's own periodic tasks: those whose queue lives there.
            found = await self.read(request, database, schedules(dashboard.app_for(database)))
            rows += [{**row, "db": database.index, "database": database.label} for row in found]
        return self.render(
            request,
            "cron.html",
            "cron_body.html",
            {"schedules": rows, "app_given": dashboard.app is not None},
        )

    async def login(self, request: Request) -> Response:
        target = _safe_next(request.query_params.get("next"))
        if request.method == "GET":
            return self.render(
                request, "login.html", "login_body.html", {"next": target, "failed": False}
            )
        fields = await _form(request)
        if not security.same_token(
            _first(fields, security.CSRF_FIELD), request.cookies.get(security.CSRF_COOKIE)
        ):
            return self.error(request, 403, "refused: reload the sign-in page and try again")
        token = self.dashboard.token
        given = _first(fields, "token")
        if token is None or not security.same_token(given, token):
            log.warning("dashboard sign-in failed from %s", _who(request, self.dashboard))
            return self.render(
                request,
                "login.html",
                "login_body.html",
                {"next": _safe_next(_first(fields, "next")), "failed": True},
                status=403,
            )
        response = RedirectResponse(
            _prefix(request) + _safe_next(_first(fields, "next")), status_code=303
        )
        response.set_cookie(
            security.AUTH_COOKIE,
            security.auth_cookie_value(token),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path=_prefix(request) or "/",
        )
        log.info("dashboard sign-in from %s", _who(request, self.dashboard))
        return response

    # -- actions -----------------------------------------------------------------------

    def on_which(self, database: Database) -> str:
        """ " on DATABASE" in a notice or a log line, when there are several."""
        return f" on {database.label}" if self.dashboard.several else ""

    def steered(
        self, request: Request, database: Database, what: str, name: str, notice: str
    ) -> Response:
        """The end of a cron or queue action, so that both log it alike: "dashboard
        {what} {name!r}", the database when there are several, and who did it."""
        log.info(
            "dashboard %s %r%s by %s",
            what,
            name,
            self.on_which(database),
            _who(request, self.dashboard),
        )
        return self.back(request, _first(request.state.fields, "next"), notice, changed=True)

    async def job_action(self, request: Request) -> Response:
        dashboard = self.dashboard
        fields: dict[str, list[str]] = request.state.fields
        job_id = int(request.path_params["job_id"])
        action = str(request.path_params["action"])
        if action not in JOB_ACTIONS:
            return self.error(request, 404, f"no action {action!r}: use retry, cancel or delete")
        database = self.database(request)
        single = _SINGLE[action]

        runs: list[object] = []  # what the action returned: retry_job, the job that runs

        def work(conn: psycopg.Connection[Any]) -> None:
            runs.append(single(dashboard.admin(database, conn), job_id))

        target = _first(fields, "next")
        try:
            await run_in_threadpool(dashboard.change, database, work)
        except JobNotFoundError as exc:
            return self.back(request, target, str(exc))
        log.info(
            "dashboard %s by %s: job ids [%d]%s",
            action,
            _who(request, dashboard),
            job_id,
            self.on_which(database),
        )
        notice = f"job {job_id}{self.on_which(database)}: {action} done"
        if action == "retry" and runs and runs[0] != job_id:  # a finished job, run again
            notice = f"job {job_id}{self.on_which(database)} enqueued again as job {runs[0]}"
        return self.back(request, target, notice, changed=True)

    async def jobs_bulk(self, request: Request) -> Response:
        dashboard = self.dashboard
        fields: dict[str, list[str]] = request.state.fields
        # "retry" acts on the ticked jobs, "retry:matching" on every live job the filter
        # matches (the filter's fields travel in the form).
        action, _, scope = (_first(fields, "action") or "").partition(":")
        if action not in _BULK or scope not in ("", "matching"):
            return self.error(request, 400, f"action={action!r}: use retry, cancel or delete")
        change, done = _BULK[action]
        target = _first(fields, "next")
        every = scope == "matching"
        database = self.database(request)
        where = reads.parse_filter({k: v[0] for k, v in fields.items() if v}) if every else None
        try:
            chosen = sorted({int(value) for value in fields.get("ids", [])})
        except ValueError:
            return self.error(request, 400, "ids must be job ids (whole numbers)")
        if not every and not chosen:
            return self.back(request, target, "no jobs selected")

        def work(conn: psycopg.Connection[Any]) -> tuple[list[int], int]:
            # The jobs matching the filter are read on the primary, in the change's own
            # transaction: an action is about what is there now, not what a replica shows.
            if where is None:
                ids = chosen
            else:
                ids = reads.matching_live_ids(conn, dashboard.schema, where)
            return ids, (change(dashboard.admin(database, conn), ids) if ids else 0)

        ids, count = await run_in_threadpool(dashboard.change, database, work)
        if not ids:
            return self.back(request, target, "no jobs match")
        log.info(
            "dashboard %s (%s) by %s: %d of %d jobs%s, job ids %s",
            action,
            "all matching" if every else "selection",
            _who(request, dashboard),
            count,
            len(ids),
            self.on_which(database),
            ids,
        )
        capped = f" (the first {reads.BULK_LIMIT} matching)" if len(ids) >= reads.BULK_LIMIT else ""
        return self.back(
            request,
            target,
            f"{count} of {plural(len(ids), 'job')}{self.on_which(database)} {done}{capped}",
            changed=True,
        )

    async def cron_action(self, request: Request) -> Response:
        """Pause, resume or run now one cron schedule (skiplock cron's three commands)."""
        dashboard = self.dashboard
        fields: dict[str, list[str]] = request.state.fields
        name = str(request.path_params["schedule"])
        action = str(request.path_params["action"])
        steer = _CRON.get(action)
        if steer is None:
            return self.error(
                request, 404, f"no cron action {action!r}: use pause, resume or run-now"
            )
        database = self.database(request)
        done: list[object] = []

        def work(conn: psycopg.Connection[Any]) -> None:
            done.append(steer(dashboard.admin(database, conn), name))

        try:
            await run_in_threadpool(dashboard.change, database, work)
        except ScheduleNotFoundError as exc:
            return self.back(request, _first(fields, "next"), str(exc))
        said = f"job {done[0]} enqueued now" if action == "run-now" else f"{action}d"
        return self.steered(
            request,
            database,
            f"cron {action}",
            name,
            f"schedule {name}{self.on_which(database)}: {said}",
        )

    async def queue_action(self, request: Request) -> Response:
        dashboard = self.dashboard
        fields: dict[str, list[str]] = request.state.fields
        queue = str(request.path_params["queue"])
        action = str(request.path_params["action"])
        check_name("queue", queue, MAX_QUEUE_NAME)
        database = self.database(request, queue=queue)
        target = _first(fields, "next")
        if action in ("pause", "resume"):
            paused = action == "pause"
            pause_or_resume = Admin.pause_queue if paused else Admin.resume_queue
            await run_in_threadpool(
                dashboard.change,
                database,
                lambda conn: pause_or_resume(dashboard.admin(database, conn), queue),
            )
            return self.steered(
                request,
                database,
                f"{action} queue",
                queue,
                f"queue {queue}{self.on_which(database)} {'paused' if paused else 'resumed'}",
            )
        if action != "limits":
            return self.error(request, 404, f"no queue action {action!r}")
        concurrency_text = (_first(fields, "concurrency") or "").strip()
        rate_text = (_first(fields, "rate") or "").strip()
        try:
            concurrency = int(concurrency_text) if concurrency_text else None
        except ValueError:
            raise ConfigurationError(
                f"concurrency {concurrency_text!r} is not a whole number"
            ) from None
        rate = parse_rate(rate_text) if rate_text else None
        await run_in_threadpool(
            dashboard.change,
            database,
            lambda conn: dashboard.admin(database, conn).set_queue_limits(
                queue, concurrency=concurrency, rate=rate
            ),
        )
        log.info(
            "dashboard limits of queue %r%s by %s: concurrency %s, rate %s",
            queue,
            self.on_which(database),
            _who(request, dashboard),
            concurrency,
            rate_text or None,
        )
        return self.back(
            request, target, f"queue {queue}{self.on_which(database)}: limits saved", changed=True
        )


class _AllowedHosts:
    """Refuses a request whose Host the dashboard does not serve (security.host_allowed)
    before any route sees it: a page of another site whose name was pointed at this
    machine (DNS rebinding) gets the refusal and nothing else."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host")
        if security.host_allowed(security.host_name(host), self.allowed):
            await self.app(scope, receive, send)
            return
        message = security.host_refusal(host)
        client_host = scope["client"][0] if scope.get("client") else "?"
        log.warning("dashboard refused %s from %s: %s", scope.get("path"), client_host, message)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = PlainTextResponse(
            message + "\n",
            status_code=403,
            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
        )
        await response(scope, receive, send)


class _RootPath:
    """Serves the app under a fixed root path (behind a proxy that strips the prefix):
    links and redirects then carry the prefix the browser sees."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not scope.get("root_path"):
            scope = {**scope, "root_path": self.root_path}
            if not scope["path"].startswith(self.root_path):
                scope["path"] = self.root_path + scope["path"]
        await self.app(scope, receive, send)


def create_app(
    database_url: str | None = None,
    schema: str | None = None,
    *,
    read_url: str | None = None,
    read_only: bool = False,
    root_path: str = "",
    token: str | None = None,
    app: App | None = None,
    refresh_seconds: float = REFRESH_SECONDS,
    allowed_hosts: Sequence[str] = (),
) -> Starlette:
    """The dashboard as an ASGI app; mount it in a Starlette or FastAPI app under any
    prefix (``Mount("/jobs", create_app(url))``), or serve it with uvicorn.

    ``read_url`` (a replica) takes every page's reads, and each page says how far behind
    it is; actions still go to ``database_url``. ``read_only`` hides and refuses every
    action. ``token`` (when set) is needed for every page: a Bearer header, or the sign-in
    form. ``root_path`` is the prefix a reverse proxy strips before passing requests on.
    ``app`` (optional) is the skiplock App whose cron schedules the cron page shows with
    their next fire times; an App with ``queue_databases`` makes the dashboard show every
    one of its databases (``database_url`` may then be left out). ``schema`` defaults to
    the App's, else "skiplock". ``allowed_hosts`` are the host names the dashboard is
    reached by besides localhost and IP addresses: a request for any other host is
    refused (DNS rebinding). See docs/dashboard.md.
    """
    if root_path and (not root_path.startswith("/") or root_path.endswith("/")):
        raise ConfigurationError(
            f"root_path {root_path!r}: start it with / and end it without one, e.g. /queue"
        )
    if refresh_seconds <= 0:
        raise ConfigurationError(f"refresh_seconds must be positive, got {refresh_seconds}")
    allowed = security.allowed_hosts(allowed_hosts)
    dashboard = Dashboard(
        dashboard_databases(database_url, read_url=read_url, app=app),
        schema or (app.schema if app is not None else DEFAULT_SCHEMA),
        read_only=read_only,
        token=token,
        app=app,
        refresh_seconds=refresh_seconds,
        allowed_hosts=allowed,
    )
    pages = Pages(dashboard)

    def page(handler: Callable[[Request], Any], *, change: bool = False) -> Any:
        async def endpoint(request: Request) -> Response:
            return await pages.guarded(request, handler, change=change)

        return endpoint

    async def health(_request: Request) -> Response:
        return PlainTextResponse("ok")

    routes = [
        Route("/", page(pages.overview), name="overview"),
        Route("/jobs", page(pages.jobs), name="jobs"),
        Route("/jobs/{job_id:int}", page(pages.job), name="job"),
        Route("/cron", page(pages.cron), name="cron"),
        Route("/workflows", page(pages.workflows), name="workflows"),
        Route("/workflows/{workflow_id:int}", page(pages.workflow), name="workflow"),
        Route("/login", pages.login, methods=["GET", "POST"], name="login"),
        Route("/health", health, name="health"),
        Route(
            "/jobs/{job_id:int}/{action}",
            page(pages.job_action, change=True),
            methods=["POST"],
            name="job_action",
        ),
        Route("/bulk", page(pages.jobs_bulk, change=True), methods=["POST"], name="jobs_bulk"),
        Route(
            "/cron/{schedule:path}/{action}",
            page(pages.cron_action, change=True),
            methods=["POST"],
            name="cron_action",
        ),
        Route(
            "/queues/{queue}/{action}",
            page(pages.queue_action, change=True),
            methods=["POST"],
            name="queue_action",
        ),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        dashboard.close()

    starlette = Starlette(routes=routes, lifespan=lifespan)
    pages.router = starlette
    starlette.state.dashboard = dashboard
    if root_path:
        starlette.add_middleware(_RootPath, root_path=root_path)
    # Added last, so outermost: before any route, static file or path rewrite.
    starlette.add_middleware(_AllowedHosts, allowed=allowed)
    return starlette
