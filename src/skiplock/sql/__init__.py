"""All of skiplock's runtime SQL, one module per concern, each statement a NounVerb constant.

Statements are templates over the schema's table names ({jobs}, {history}, {workers});
``render`` composes them with ``psycopg.sql`` once per schema, and values are always
passed as parameters.
"""

from __future__ import annotations

from functools import lru_cache

from psycopg import sql


@lru_cache(maxsize=512)
def render(template: str, schema: str) -> str:
    """The statement with table names qualified by ``schema`` and safely quoted."""
    composed = sql.SQL(template).format(
        jobs=sql.Identifier(schema, "jobs"),
        history=sql.Identifier(schema, "job_history"),
        workers=sql.Identifier(schema, "workers"),
        leader=sql.Identifier(schema, "leader"),
        queues=sql.Identifier(schema, "queues"),
        periodic=sql.Identifier(schema, "periodic"),
        unique_windows=sql.Identifier(schema, "unique_windows"),
        key_rates=sql.Identifier(schema, "key_rates"),
        workflows=sql.Identifier(schema, "workflows"),
        workflow_steps=sql.Identifier(schema, "workflow_steps"),
        job_steps=sql.Identifier(schema, "job_steps"),
        signals=sql.Identifier(schema, "signals"),
        schema=sql.Identifier(schema),
    )
    return composed.as_string(None)
