"""The web dashboard (``pip install 'skiplock[dashboard]'``): queues, workers, jobs and
cron schedules in a browser, with the CLI's actions. ``create_app`` returns an ASGI app to
mount in a Starlette or FastAPI application, or to serve with ``skiplock dashboard``.

Starlette and Jinja2 are imported on first use of ``create_app``, so that the CLI can
list the ``dashboard`` command without the extra installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skiplock.dashboard.web import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from skiplock.dashboard.web import create_app  # noqa: PLC0415

        return create_app
    raise AttributeError(f"module 'skiplock.dashboard' has no attribute {name!r}")
