"""Login roles for tests that run skiplock as a role that owns nothing.

Roles are cluster-wide, so each has a random name and is dropped when its test ends,
passed or failed: its sessions are ended, and what it owns or was granted in the test
database goes with ``DROP OWNED`` (grants live in that database only). Trust
authentication on 127.0.0.1 and on the embedded server's socket lets any role log in.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo


def url_as(url: str, role: str) -> str:
    """``url`` with ``role`` as the user (and no password)."""
    params = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    params["user"] = role
    params.pop("password", None)
    return make_conninfo("", **params)


class Roles:
    """Creates login roles over an administrator's connection; drops them all at the end."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.created: list[str] = []

    def create(self, use: str, *settings: tuple[str, str]) -> tuple[str, str]:
        """A new LOGIN role (no other attribute) and a URL that connects as it. ``settings``
        are (parameter, value) pairs set on the role, applied at each of its logins."""
        role = f"skiplock_test_{use}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(self.url, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            self.created.append(role)
            for name, value in settings:
                admin.execute(
                    sql.SQL("ALTER ROLE {} SET {} = {}").format(
                        sql.Identifier(role), sql.Identifier(name), sql.Literal(value)
                    )
                )
        return role, url_as(self.url, role)

    def drop_all(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as admin:
            for role in self.created:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (role,),
                )
                ident = sql.Identifier(role)
                admin.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(ident))
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(ident))
        self.created.clear()


@contextmanager
def login_roles(url: str) -> Iterator[Roles]:
    """Roles created in the block are dropped when it ends, however it ends."""
    roles = Roles(url)
    try:
        yield roles
    finally:
        roles.drop_all()
