"""The dashboard as an ASGI application (Starlette routes, Jinja2 pages).

Every page is a plain GET; its live part is re-fetched with ``?fragment=1`` by the page's
script and swapped in, so nothing but a small vendored script runs in the browser. Every
change is a POST through the same client functions the CLI uses (``client.retry_jobs``,
``client.set_queue_paused``, ...), guarded by the checks of ``security`` and logged.

Database work is synchronous psycopg on a small pool, run in Starlette's thread pool. The
pool opens on first use, not at startup: mounted inside another application, this app's
lifespan never runs.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode

import jinja2
import psycopg
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from skiplock import client
from skiplock.config import validate_schema
from skiplock.dashboard import reads, security
from skiplock.errors import ConfigurationError, JobNotFoundError
from skiplock.sql import dashboard as dashboard_sql
from skiplock.sql import render
from skiplock.tasks import MAX_QUEUE_NAME, check_name, parse_rate

if TYPE_CHECKING:
    from skiplock.app import App

log = logging.getLogger("skiplock.dashboard")
T = TypeVar("T")

_HERE = Path(__file__).parent
NOTICE_COOKIE = "skiplock_notice"
# Reads that take longer are cancelled: a text search over a large history should fail
# with advice (narrow the time range), not hold a connection for minutes.
STATEMENT_TIMEOUT_MS = 15_000
REFRESH_SECONDS = 3.0
JOB_ACTIONS = ("retry", "cancel", "delete")
# A queue with settings but no jobs (paused while empty) still gets its row.
_NO_JOBS: dict[str, Any] = dict.fromkeys(
    ("blocked", "available", "scheduled", "running", "retryable", "dead", "workers"), 0
) | {"oldest_ready_seconds": None}
_BULK = {
    "retry": (client.retry_jobs, "made available again"),
    "cancel": (client.cancel_jobs, "cancelled (running ones asked to stop)"),
    "delete": (client.delete_jobs, "deleted"),
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
    return environment


def _when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def _compact(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Dashboard:
    """The state behind the routes: where the database is, the pool, the settings."""

    def __init__(
        self,
        database_url: str,
        schema: str,
        *,
        read_only: bool,
        token: str | None,
        app: App | None,
        refresh_seconds: float,
    ) -> None:
        self.database_url = database_url
        self.schema = validate_schema(schema)
        self.read_only = read_only
        self.token = token or None
        self.app = app
        self.refresh_seconds = refresh_seconds
        self.templates = _environment()
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._pool_lock = threading.Lock()

    def pool(self) -> ConnectionPool[psycopg.Connection[Any]]:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.database_url,
                    min_size=1,
                    max_size=4,
                    open=True,
                    # No server-side prepared statements: each statement is planned with
                    # its values (see skiplock.sql.dashboard).
                    kwargs={
                        "autocommit": True,
                        "prepare_threshold": None,
                        "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
                        "application_name": "skiplock dashboard",
                    },
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def read(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        with self.pool().connection() as conn:
            return work(conn)

    def change(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``work`` in one transaction, as the CLI runs its changes."""
        with self.pool().connection() as conn, conn.transaction():
            return work(conn)


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
        }
        fragment = request.query_params.get("fragment") == "1"
        name = body if fragment else template
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

    def back(self, request: Request, target: str | None, notice: str) -> Response:
        response = RedirectResponse(_prefix(request) + _safe_next(target), status_code=303)
        response.set_cookie(
            NOTICE_COOKIE, notice[:300], httponly=True, samesite="strict",
            path=_prefix(request) or "/",
        )  # fmt: skip
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
        hosts = [request.headers.get("host"), request.headers.get("x-forwarded-host")]
        origin = request.headers.get("origin")
        if not any(security.origin_allowed(origin, host) for host in hosts if host) and (
            origin is not None
        ):
            raise ForbiddenError(f"refused: the request came from another site ({origin})")
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
        dashboard = self.dashboard

        def work(conn: psycopg.Connection[Any]) -> dict[str, Any]:
            now = reads.database_now(conn, dashboard.schema)
            stats = {row["queue"]: row for row in reads.queue_counts(conn, dashboard.schema)}
            settings = {row["name"]: row for row in client.list_queues(conn, dashboard.schema)}
            busy = dict(
                conn.execute(render(dashboard_sql.WORKER_BUSY, dashboard.schema)).fetchall()
            )
            queues = []
            for name in sorted(set(stats) | set(settings)):
                row: dict[str, Any] = {**_NO_JOBS, "queue": name, **stats.get(name, {})}
                setting = settings.get(name, {})
                row["paused"] = bool(setting.get("paused"))
                row["concurrency_limit"] = setting.get("concurrency_limit")
                row["rate_limit"] = setting.get("rate_limit")
                row["rate_period"] = setting.get("rate_period")
                queues.append(row)
            workers = client.list_workers(conn, dashboard.schema)
            for worker in workers:
                worker["busy"] = busy.get(worker["id"], 0)
            return {
                "now": now,
                "queues": queues,
                "workers": workers,
                "chart": reads.throughput(conn, dashboard.schema, now),
            }

        context = await run_in_threadpool(dashboard.read, work)
        return self.render(request, "overview.html", "overview_body.html", context)

    async def jobs(self, request: Request) -> Response:
        dashboard = self.dashboard
        where = reads.parse_filter(request.query_params)
        before = reads.parse_before(request.query_params.get("before"))

        def work(conn: psycopg.Connection[Any]) -> reads.Page:
            return reads.jobs_page(conn, dashboard.schema, where, before, reads.PAGE_SIZE)

        page = await run_in_threadpool(dashboard.read, work)
        query = where.query()
        next_url = (
            self.url(request, "jobs") + "?" + urlencode({**query, "before": page.next_before})
            if page.next_before
            else None
        )
        first_url = (
            self.url(request, "jobs") + ("?" + urlencode(query) if query else "")
            if before
            else None
        )
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
            },
        )

    async def job(self, request: Request) -> Response:
        dashboard = self.dashboard
        job_id = int(request.path_params["job_id"])

        def work(conn: psycopg.Connection[Any]) -> tuple[dict[str, Any] | None, datetime]:
            return (
                reads.job_detail(conn, dashboard.schema, job_id),
                reads.database_now(conn, dashboard.schema),
            )

        job, now = await run_in_threadpool(dashboard.read, work)
        if job is None:
            return self.error(request, 404, f"no job with id {job_id} (live or in history)")
        errors = [
            {**error, "lines": reads.traceback_lines(error.get("traceback"))}
            for error in job["errors"]
        ]
        return self.render(
            request,
            "job.html",
            "job_body.html",
            {"job": job, "errors": errors, "timeline": reads.timeline(job), "now": now},
        )

    async def cron(self, request: Request) -> Response:
        dashboard = self.dashboard

        def work(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
            now = reads.database_now(conn, dashboard.schema)
            return reads.cron_rows(conn, dashboard.schema, dashboard.app, now)

        rows = await run_in_threadpool(dashboard.read, work)
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

    async def job_action(self, request: Request) -> Response:
        dashboard = self.dashboard
        fields: dict[str, list[str]] = request.state.fields
        job_id = int(request.path_params["job_id"])
        action = str(request.path_params["action"])
        if action not in JOB_ACTIONS:
            return self.error(request, 404, f"no action {action!r}: use retry, cancel or delete")
        single = {"retry": client.retry_job, "cancel": client.cancel_job}.get(
            action, client.delete_job
        )

        def work(conn: psycopg.Connection[Any]) -> None:
            single(conn, dashboard.schema, job_id)

        target = _first(fields, "next")
        try:
            await run_in_threadpool(dashboard.change, work)
        except JobNotFoundError as exc:
            return self.back(request, target, str(exc))
        log.info("dashboard %s by %s: job ids [%d]", action, _who(request, dashboard), job_id)
        return self.back(request, target, f"job {job_id}: {action} done")

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
        if every:
            where = reads.parse_filter({k: v[0] for k, v in fields.items() if v})
            ids = await run_in_threadpool(
                dashboard.read,
                lambda conn: reads.matching_live_ids(conn, dashboard.schema, where),
            )
        else:
            try:
                ids = sorted({int(value) for value in fields.get("ids", [])})
            except ValueError:
                return self.error(request, 400, "ids must be job ids (whole numbers)")
        if not ids:
            return self.back(request, target, "no jobs selected" if not every else "no jobs match")
        count = await run_in_threadpool(
            dashboard.change, lambda conn: change(conn, dashboard.schema, ids)
        )
        log.info(
            "dashboard %s (%s) by %s: %d of %d jobs, job ids %s",
            action,
            "all matching" if every else "selection",
            _who(request, dashboard),
            count,
            len(ids),
            ids,
        )
        capped = f" (the first {reads.BULK_LIMIT} matching)" if len(ids) >= reads.BULK_LIMIT else ""
        return self.back(request, target, f"{count} of {len(ids)} jobs {done}{capped}")

    async def queue_action(self, request: Request) -> Response:
        dashboard = self.dashboard
        fields: dict[str, list[str]] = request.state.fields
        queue = str(request.path_params["queue"])
        action = str(request.path_params["action"])
        check_name("queue", queue, MAX_QUEUE_NAME)
        target = _first(fields, "next")
        if action in ("pause", "resume"):
            paused = action == "pause"
            await run_in_threadpool(
                dashboard.change,
                lambda conn: client.set_queue_paused(conn, dashboard.schema, queue, paused=paused),
            )
            log.info("dashboard %s queue %r by %s", action, queue, _who(request, dashboard))
            return self.back(request, target, f"queue {queue} {'paused' if paused else 'resumed'}")
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
            lambda conn: client.set_queue_limits(
                conn, dashboard.schema, queue, concurrency=concurrency, rate=rate
            ),
        )
        log.info(
            "dashboard limits of queue %r by %s: concurrency %s, rate %s",
            queue,
            _who(request, dashboard),
            concurrency,
            rate_text or None,
        )
        return self.back(request, target, f"queue {queue}: limits saved")


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
    database_url: str,
    schema: str = "skiplock",
    *,
    read_only: bool = False,
    root_path: str = "",
    token: str | None = None,
    app: App | None = None,
    refresh_seconds: float = REFRESH_SECONDS,
) -> Starlette:
    """The dashboard as an ASGI app; mount it in a Starlette or FastAPI app under any
    prefix (``Mount("/jobs", create_app(url))``), or serve it with uvicorn.

    ``read_only`` hides and refuses every action. ``token`` (when set) is needed for every
    page: a Bearer header, or the sign-in form. ``root_path`` is the prefix a reverse proxy
    strips before passing requests on. ``app`` (optional) is the skiplock App whose cron
    schedules the cron page shows with their next fire times.
    """
    if root_path and (not root_path.startswith("/") or root_path.endswith("/")):
        raise ConfigurationError(
            f"root_path {root_path!r}: start it with / and end it without one, e.g. /queue"
        )
    if refresh_seconds <= 0:
        raise ConfigurationError(f"refresh_seconds must be positive, got {refresh_seconds}")
    dashboard = Dashboard(
        database_url,
        schema,
        read_only=read_only,
        token=token,
        app=app,
        refresh_seconds=refresh_seconds,
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
    return starlette
