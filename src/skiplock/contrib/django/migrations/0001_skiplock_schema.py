"""skiplock's tables, in the database of each SkiplockBackend (skiplock.contrib.django.schema).

Not atomic: skiplock's migrations commit one by one, and some build indexes concurrently,
which PostgreSQL refuses inside a transaction. Not reversed: unapplying it leaves the jobs
where they are (drop the schema by hand to remove them).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def apply_skiplock_schema(apps: Any, schema_editor: Any) -> None:
    from skiplock.contrib.django.schema import apply_schema  # noqa: PLC0415

    apply_schema(schema_editor.connection)


class Migration(migrations.Migration):
    atomic = False
    initial = True
    dependencies: list[tuple[str, str]] = []  # noqa: RUF012 - Django's own attributes
    operations = [  # noqa: RUF012
        migrations.RunPython(apply_skiplock_schema, migrations.RunPython.noop, elidable=False)
    ]
