"""examples/django_shop runs as its README says, on a database of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

SHOP = Path(__file__).resolve().parent.parent / "examples" / "django_shop"


@pytest.fixture
def shop_database() -> Iterator[str]:
    name = f"django_shop_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(settings.SERVER, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = {k: str(v) for k, v in conninfo_to_dict(settings.SERVER).items() if v is not None}
    params["dbname"] = name
    try:
        yield make_conninfo("", **params)
    finally:
        with psycopg.connect(settings.SERVER, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def manage(database_url: str, *command: str) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DJANGO_SETTINGS_MODULE", "SKIPLOCK_SCHEMA")
    }
    env["DATABASE_URL"] = database_url
    done = subprocess.run(
        [sys.executable, "manage.py", *command],
        cwd=SHOP,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout


def test_the_shop_demo(shop_database: str) -> None:
    migrated = manage(shop_database, "migrate")
    assert "Applying skiplock.0001_skiplock_schema... OK" in migrated

    transcript = manage(shop_database, "shop_demo")

    assert "orders saved: 0" in transcript
    assert "receipt job 1: TaskResultDoesNotExist (never committed)" in transcript
    assert "receipt job 2: READY" in transcript
    assert "worker printed the mail: To: bob@example.com" in transcript
    assert "status: SUCCESSFUL" in transcript
    assert "return_value: {'to': 'bob@example.com', 'order': 2}" in transcript
    with psycopg.connect(shop_database) as conn:
        sent = conn.execute("SELECT receipt_sent_at IS NOT NULL FROM orders_order").fetchall()
        schemas = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname IN ('skiplock', 'django_shop')"
        ).fetchall()
    assert sent == [(True,)]
    assert schemas == [("django_shop",)]  # its own, apart from the tutorial's and others'


def test_an_order_that_was_never_placed_is_a_404(shop_database: str) -> None:
    manage(shop_database, "migrate")
    # The view over HTTP, through Django's test client (its Host one the settings allow).
    probe = (
        "from django.test import Client; c = Client(HTTP_HOST='localhost'); "
        "r = c.get('/orders/999'); print(r.status_code, r.content.decode())"
    )

    said = manage(shop_database, "shell", "-c", probe)

    # (Django 5.2's shell may first say what it imported.)
    assert said.strip().splitlines()[-1] == '404 {"error": "no order 999"}'
