"""Queues over several databases: the routing table (queue -> database URL), its checks,
and which database a connection is on (docs/routing.md, decision 020).

The decisions are pure; the two thin shells below only run one SELECT. A caller's
connection is identified once and remembered for its lifetime, so an App with routes pays
one round trip per connection, not per enqueue; an App without routes pays nothing.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from skiplock.config import EMBEDDED
from skiplock.errors import ConfigurationError, EnqueueError
from skiplock.sql.routing import DATABASE_IDENTITY
from skiplock.tasks import MAX_QUEUE_NAME, check_name

# (cluster system identifier, database oid), as the server says: equal means the same
# database, however the URLs that reached it are spelled.
Identity = tuple[str, str]

_connection_identities: weakref.WeakKeyDictionary[Any, Identity] = weakref.WeakKeyDictionary()


def check_routes(routes: Mapping[str, str] | None) -> dict[str, str]:
    """The routing table, validated: queue names as everywhere, URLs that parse. Pure."""
    if routes is None:
        return {}
    if not isinstance(routes, Mapping):
        raise ConfigurationError(
            f"queue_databases must map queue names to database URLs, "
            f"e.g. {{'reports': 'postgresql://HOST/reports'}}, got {type(routes).__name__}"
        )
    checked: dict[str, str] = {}
    for queue, url in routes.items():
        check_name("queue", queue, MAX_QUEUE_NAME)
        checked[queue] = check_database_url(url, f"queue_databases[{queue!r}]")
    return checked


def describe_url(url: str) -> str:
    """``host:port/dbname`` of a URL: names a database in a message, never a password
    (a raw ``@`` in one makes libpq take its tail for the host: the host is then what
    follows the last ``@``)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<a malformed URL>"
    host = params.get("host")
    if isinstance(host, str) and "@" in host:
        host = host.rpartition("@")[2]
    return _where(host, params.get("port"), params.get("dbname"))


MASK = "***"
# libpq quotes the token it stopped at in double quotes, psycopg a host in single ones.
_QUOTED = re.compile(r""""([^"]*)"|'([^']*)'""")
_NEXT_SETTING = re.compile(r"\s+[A-Za-z_]+\s*=")
_SETTING_PASSWORD = re.compile(r"(?:^|\s)password\s*=\s*")
_QUERY_PASSWORD = re.compile(r"[?&]password=([^&]*)")


def without_password(url: str) -> str:
    """``url`` with any password replaced by ``***`` (routing.without_passwords)."""
    return without_passwords(url, url)


def database_url_problem(url: object) -> str | None:
    """Why ``url`` cannot name a PostgreSQL database (a sentence naming the expected
    form), or None when it can. Checked before connecting, so that a typo reads as one
    line, like a refused connection, rather than as the driver's traceback. Neither the
    URL nor libpq's reason, which quotes the token it stopped at, shows the password.
    Pure."""
    if url == EMBEDDED:
        return None
    expected = "expected postgresql://USER@HOST:PORT/DBNAME (or key=value settings)"
    if not isinstance(url, str) or not url.strip():
        return f"{expected}, got {url!r}"
    scheme, separator, _ = url.partition("://")
    if separator and scheme.lower() not in ("postgresql", "postgres"):
        return (
            f"the database URL starts with {scheme}://, and skiplock needs PostgreSQL: {expected}"
        )
    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = without_passwords(str(exc).strip(), url)
        if reason.startswith('missing "="'):  # the driver took it for key=value settings
            reason = "neither a URL nor key=value settings"
        return f"the database URL {without_password(url)!r} is malformed ({reason}); {expected}"
    return None


def check_database_url(url: object, where: str) -> str:
    """``url`` if it can name a PostgreSQL database, else a ConfigurationError saying
    ``where`` it was given and why not, in one line (database_url_problem)."""
    problem = database_url_problem(url)
    if problem is not None:
        raise ConfigurationError(f"{where}: {problem}")
    assert isinstance(url, str)
    return url


def without_passwords(text: str, *urls: str | None) -> str:
    """``text`` (a URL, or libpq's or skiplock's message about one) with each URL's
    password as ``***``, and every token libpq quoted from it that is part of that
    password.

    A malformed URL's error quotes the token libpq stopped at (``invalid
    percent-encoded token: "s3cr%t"``), and a raw ``@`` in a password makes libpq read
    its tail as the host (``could not translate host name "tail@db.example"``): the
    password is taken generously, up to the last ``@``, and any quoted token that
    overlaps it, as written or percent-decoded, is masked. Pure."""
    for url in urls:
        if url:
            text = _mask(text, url)
    return text


class PasswordsMasked(logging.Filter):
    """A logging filter (for a handler) that passes every record through
    ``without_passwords`` for ``urls``: a worker's "cannot reach the database" and
    psycopg_pool's warnings quote a host that may be a password's tail."""

    def __init__(self, *urls: str) -> None:
        super().__init__()
        self.urls = list(urls)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.urls:
            record.msg = without_passwords(record.getMessage(), *self.urls)
            record.args = None
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text:
                record.exc_text = without_passwords(record.exc_text, *self.urls)
        return True


def _mask(text: str, url: str) -> str:
    spans = _password_spans(url)
    if not spans:
        return text
    masked_url = _replace_spans(url, spans)
    text = text.replace(url, masked_url)
    decoded, decoded_spans = _decoded(url, spans)

    def token(match: re.Match[str]) -> str:
        quoted = match.group(1) if match.group(1) is not None else match.group(2)
        if quoted and (_overlaps(quoted, url, spans) or _overlaps(quoted, decoded, decoded_spans)):
            mark = match.group(0)[0]
            return f"{mark}{MASK}{mark}"
        return match.group(0)

    text = _QUOTED.sub(token, text)
    for start, end in [*spans, *decoded_spans]:  # the whole password, unquoted
        haystack = url if (start, end) in spans else decoded
        secret = haystack[start:end]
        if len(secret) >= 4:
            text = text.replace(secret, MASK)
    return text


def _password_spans(url: str) -> list[tuple[int, int]]:
    """Where ``url`` holds a password: (start, end) offsets. Pure."""
    scheme, separator, _ = url.partition("://")
    if not separator:  # key=value settings
        spans = []
        for found in _SETTING_PASSWORD.finditer(url):
            start = found.end()
            if url.startswith("'", start):  # a quoted value, to its closing quote
                close = re.compile(r"(?<!\\)'").search(url, start + 1)
                end = close.end() if close else len(url)
            else:  # unquoted: taken to the next setting (a space in it is an error)
                following = _NEXT_SETTING.search(url, start)
                end = following.start() if following else len(url)
            spans.append((start, end))
        return spans
    start = len(scheme) + len(separator)
    spans = [found.span(1) for found in _QUERY_PASSWORD.finditer(url)]
    colon, first_at = url.find(":", start), url.find("@", start)
    slash = url.find("/", start)
    if colon < 0 or first_at < colon:  # no user:...@
        return spans
    if 0 <= slash < first_at and url[colon + 1 : slash].isdigit():
        return spans  # HOST:PORT/..., an @ further on: no password there
    end = url.rfind("@")  # malformed: anything up to the last @ may be the password
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return [(colon + 1, end), *spans]
    if slash < 0 or first_at < slash:  # libpq's user:password@, the host may hold more @
        host = re.compile(r"[/?]").search(url, first_at)
        end = max(first_at, url.rfind("@", first_at, host.start() if host else len(url)))
    return [(colon + 1, end), *spans]


def _replace_spans(text: str, spans: list[tuple[int, int]]) -> str:
    for start, end in sorted(spans, reverse=True):
        text = text[:start] + MASK + text[end:]
    return text


def _decoded(url: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]]]:
    """``url`` percent-decoded as libpq decodes its parts, and where its spans went."""
    pieces, moved, position = [], [], 0
    for start, end in sorted(spans):
        pieces.append(unquote(url[position:start]))
        secret = unquote(url[start:end])
        offset = sum(len(piece) for piece in pieces)
        moved.append((offset, offset + len(secret)))
        pieces.append(secret)
        position = end
    pieces.append(unquote(url[position:]))
    return "".join(pieces), moved


def _overlaps(token: str, haystack: str, spans: list[tuple[int, int]]) -> bool:
    """Whether any occurrence of ``token`` in ``haystack`` overlaps one of ``spans``."""
    at = haystack.find(token)
    while at >= 0:
        if any(at < end and start < at + len(token) for start, end in spans):
            return True
        at = haystack.find(token, at + 1)
    return False


def describe_connection(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    info = conn.info
    return _where(info.host, info.port, info.dbname)


def _where(host: object, port: object, dbname: object) -> str:
    return f"{host or 'localhost'}:{port or 5432}/{dbname or '(default)'}"


def group_queues(
    queues: Iterable[str], default_url: str, routes: Mapping[str, str]
) -> dict[str, list[str]]:
    """Database URL -> the given queues that live there, the default database first. Pure."""
    groups: dict[str, list[str]] = {}
    for queue in dict.fromkeys(queues):
        groups.setdefault(routes.get(queue, default_url), []).append(queue)
    return dict(sorted(groups.items(), key=lambda item: item[0] != default_url))


def single_database(queues: Iterable[str], default_url: str, routes: Mapping[str, str]) -> str:
    """The one database a batch of jobs goes to; EnqueueError when it spans several (one
    transaction cannot write to two databases). Pure."""
    groups = group_queues(queues, default_url, routes)
    if len(groups) > 1:
        spread = "; ".join(
            f"{', '.join(sorted(q))} on {describe_url(url)}" for url, q in groups.items()
        )
        raise EnqueueError(
            f"these jobs belong to several databases ({spread}), and one transaction cannot "
            "write to more than one: enqueue each database's jobs in its own call, on a "
            "connection to that database (app.connect(queue=...))"
        )
    return next(iter(groups), default_url)


def wrong_database(
    queue: str, wanted_url: str, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
) -> EnqueueError:
    return EnqueueError(
        f"queue {queue!r} lives on database {describe_url(wanted_url)}, but this connection "
        f"is to {describe_connection(conn)}: a job is written in the caller's transaction "
        "only on its own queue's database. Enqueue it on a connection to that database "
        f"(app.connect(queue={queue!r})); there is no transaction across databases"
    )


def connection_identity(conn: psycopg.Connection[Any]) -> Identity:
    """Which database ``conn`` is on, asked once per connection (inside its transaction,
    if one is open: a read that changes nothing)."""
    known = _connection_identities.get(conn)
    if known is None:
        row = conn.execute(DATABASE_IDENTITY).fetchone()
        assert row is not None
        known = _connection_identities[conn] = (str(row[0]), str(row[1]))
    return known


async def connection_identity_async(conn: psycopg.AsyncConnection[Any]) -> Identity:
    known = _connection_identities.get(conn)
    if known is None:
        cur = await conn.execute(DATABASE_IDENTITY)
        row = await cur.fetchone()
        assert row is not None
        known = _connection_identities[conn] = (str(row[0]), str(row[1]))
    return known


def url_identity(url: str) -> Identity:
    """Which database ``url`` reaches (one short connection; the App remembers it)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return connection_identity(conn)


async def url_identity_async(url: str, **kwargs: Any) -> Identity:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True, **kwargs) as conn:
        return await connection_identity_async(conn)


def same_database_urls(identities: Mapping[str, Identity | None]) -> dict[str, list[str]]:
    """URL -> every URL of ``identities`` that reaches the same database (itself included),
    by identity; a URL whose identity is unknown (None) is only itself. Pure."""
    return {
        url: [
            other
            for other, known in identities.items()
            if other == url or (identity is not None and known == identity)
        ]
        for url, identity in identities.items()
    }
