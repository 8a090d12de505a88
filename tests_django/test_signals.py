"""A signal sent from a Django view's transaction (docs/durable.md): ``App.signal`` on the
psycopg connection Django's ``atomic()`` block runs on commits with the view's writes,
and a rolled-back block sends nothing."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

import skiplock
from tests_django.taskapp.models import Ran

pytestmark = pytest.mark.django_db(transaction=True)

# No database URL: App.signal uses the connection it is given, and only the schema.
app = skiplock.App(schema="skiplock")


def kept() -> list[tuple[str, object]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, payload::text FROM skiplock.signals ORDER BY id")
        return [(key, payload) for key, payload in cursor.fetchall()]


def test_a_signal_sent_in_atomic_commits_or_rolls_back_with_the_views_writes() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Ran.objects.create(label="approved 1")
        assert app.signal(connection.connection, "review:1", {"approved": True}) is None
        raise RuntimeError("the view failed after the signal")
    with transaction.atomic():
        Ran.objects.create(label="approved 2")
        app.signal(connection.connection, "review:2", {"approved": True})

    assert kept() == [("review:2", '{"approved": true}')]
    assert list(Ran.objects.values_list("label", flat=True)) == ["approved 2"]
