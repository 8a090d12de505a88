"""The web dashboard (``pip install 'skiplock[dashboard]'``): queues, workers, jobs and
cron schedules in a browser, with the CLI's actions. ``create_app`` returns an ASGI app to
mount in a Starlette or FastAPI application, or to serve with ``skiplock dashboard``."""

from skiplock.dashboard.web import create_app

__all__ = ["create_app"]
