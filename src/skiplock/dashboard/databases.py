"""Which databases the dashboard shows, where each one's pages read and its actions
write, and which of them a request is about; pure decisions, no connection in sight.

- One database (``database_url``), or every database of an App with routes
  (``queue_databases``), in ``App.databases()`` order: database_url first. A request
  names its database by that position, ``?db=N`` (job ids are unique per database only).
- A read URL (a replica) moves every page's reads there; actions still go to the primary.
  It names one replica, so it is refused with an App over several databases (the same
  check as the CLI's, ``skiplock.replica.check_one_database``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
from psycopg.conninfo import conninfo_to_dict

from skiplock.dashboard.reads import FilterError
from skiplock.errors import ConfigurationError
from skiplock.replica import check_one_database
from skiplock.routing import describe_url, without_passwords

if TYPE_CHECKING:
    from skiplock.app import App

DB_PARAM = "db"


@dataclass(frozen=True)
class Database:
    """One database on the dashboard. ``url`` is its primary, where every action goes;
    ``read_url``, when given, the replica every page reads instead. ``label`` names it
    on the page (``host:port/dbname``: never a password)."""

    index: int
    url: str
    read_url: str | None
    label: str

    @property
    def reads_from(self) -> str:
        return self.read_url or self.url


def _checked(url: str, what: str) -> str:
    """``url`` if it parses; a message naming it without its password if not."""
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = without_passwords(str(exc).strip(), url)
        raise ConfigurationError(
            f"{what} is malformed ({reason}); expected postgresql://USER@HOST:PORT/DBNAME"
        ) from None
    return url


def dashboard_databases(
    database_url: str | None, *, read_url: str | None, app: App | None
) -> list[Database]:
    """The databases of a dashboard: ``database_url`` alone, or with an App with routes
    every database of that App (``database_url`` may then be left out, or must be the
    App's)."""
    check_one_database(read_url, app)
    if app is not None and app.queue_databases:
        if database_url is not None and database_url != app.database_url:
            raise ConfigurationError(
                f"database_url {describe_url(database_url)} is not the database_url of the "
                f"App ({describe_url(app.database_url)}), whose queues live on several "
                "databases: leave database_url out (create_app(app=app)) to show every one"
            )
        urls = app.databases()
    elif database_url is not None:
        urls = [database_url]
    elif app is not None:
        urls = [app.database_url]
    else:
        raise ConfigurationError("create_app needs a database_url, or an App (app=)")
    if read_url is not None:
        _checked(read_url, "the read URL")
    return [
        Database(index, _checked(url, "the database URL"), read_url, describe_url(url))
        for index, url in enumerate(urls)
    ]


def pick_database(
    databases: list[Database],
    params: Mapping[str, str],
    *,
    queue: str | None = None,
    app: App | None = None,
) -> Database:
    """The database a request is about: ``?db=N`` when given; else, for a request about a
    queue, the database the App routes that queue to; else the first (database_url)."""
    text = (params.get(DB_PARAM) or "").strip()
    if text:
        try:
            index = int(text)
        except ValueError:
            index = -1
        if not 0 <= index < len(databases):
            choices = ", ".join(f"{d.index} ({d.label})" for d in databases)
            raise FilterError(f"db={text!r} is not a database of this dashboard: use {choices}")
        return databases[index]
    if queue is not None and app is not None and app.queue_databases:
        wanted = app.database_url_for(queue)
        for database in databases:
            if database.url == wanted:
                return database
    return databases[0]
