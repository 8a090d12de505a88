"""All of skiplock's runtime SQL, one module per concern, each statement a NounVerb constant.

Statements are templates over the schema's table names ({jobs}, {history}, {workers});
``render`` composes them with ``psycopg.sql`` once per schema, and values are always
passed as parameters.
"""

from __future__ import annotations

from functools import lru_cache

from psycopg import sql

# The placeholders of a template, and the table each names (all but {history} by itself).
TABLES = {
    "jobs": "jobs",
    "history": "job_history",
    "workers": "workers",
    "leader": "leader",
    "queues": "queues",
    "periodic": "periodic",
    "unique_windows": "unique_windows",
    "key_rates": "key_rates",
    "workflows": "workflows",
    "workflow_steps": "workflow_steps",
    "job_steps": "job_steps",
    "signals": "signals",
}


@lru_cache(maxsize=512)
def render(template: str, schema: str) -> str:
    """The statement with table names qualified by ``schema`` and safely quoted."""
    names = {name: sql.Identifier(schema, table) for name, table in TABLES.items()}
    composed = sql.SQL(template).format(**names, schema=sql.Identifier(schema))
    return composed.as_string(None)
