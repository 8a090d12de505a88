"""Least privilege: the GRANT statements for a role that runs workers, enqueues jobs, or
operates the queue (``skiplock grant ROLE --worker|--enqueue|--admin [--apply]``).

The schema's owner (the role that runs ``skiplock migrate``) owns every table; the roles
here own nothing. The only step that needs ownership, creating and dropping history
partitions, goes through two SECURITY DEFINER functions of the owner (migration 0012),
which are granted to the worker and the operator only.

Each table of the schema has an entry here for every use, so a migration that adds a
table must decide who may touch it (a test compares this map with the catalog).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import psycopg
from psycopg import sql

from skiplock.config import validate_schema
from skiplock.errors import SkiplockError
from skiplock.migrate import check_schema_ready
from skiplock.sql import grants


class Use(StrEnum):
    WORKER = "worker"
    ENQUEUE = "enqueue"
    ADMIN = "admin"


_ALL = ("SELECT", "INSERT", "UPDATE", "DELETE")

# The columns an enqueue writes, and no others (decision 022). Not the id: the table's
# default gives it, so an id taken by hand can never collide with an application's
# enqueue. Not the lease, attempts, errors or progress: only a worker writes those, so an
# enqueue-only role cannot make a running row (jobs_lease_iff_running needs a worker and a
# lease) nor a record a page or a rescue must distrust.
ENQUEUE_COLUMNS = (
    "queue",
    "task",
    "args",
    "priority",
    "run_at",
    "state",
    "max_attempts",
    "unique_key",
    "unique_queued_key",
    "ordering_key",
    "key_limit",
    "key_rate",
    "key_period",
    "meta",
    "workflow_id",
)
_ENQUEUE_INSERT = f"INSERT ({', '.join(ENQUEUE_COLUMNS)})"

# What each use does to each table, and no more. TRUNCATE, REFERENCES and TRIGGER are
# never granted; schema_migrations is written by the owner alone.
TABLES: dict[str, dict[Use, tuple[str, ...]]] = {
    # Enqueue inserts and reads its jobs (a unique enqueue looks the holder up); the
    # worker claims, completes and rescues; the operator retries, cancels and deletes.
    # Every use inserts the enqueue columns only (a worker enqueues cron ticks and
    # handlers' jobs through the same statements), so granting two uses to one role, in
    # either order, gives the same.
    "jobs": {
        Use.WORKER: ("SELECT", _ENQUEUE_INSERT, "UPDATE", "DELETE"),
        Use.ENQUEUE: ("SELECT", _ENQUEUE_INSERT),
        Use.ADMIN: ("SELECT", _ENQUEUE_INSERT, "UPDATE", "DELETE"),
    },
    # Completions and cancellations insert; results are read from here.
    "job_history": {
        Use.WORKER: ("SELECT", "INSERT"),
        Use.ENQUEUE: ("SELECT",),
        Use.ADMIN: ("SELECT", "INSERT"),
    },
    # Pruned directly (rows that arrived before their day's partition existed).
    "job_history_default": {
        Use.WORKER: ("SELECT", "DELETE"),
        Use.ENQUEUE: (),
        Use.ADMIN: ("SELECT", "DELETE"),
    },
    "workers": {Use.WORKER: _ALL, Use.ENQUEUE: (), Use.ADMIN: ("SELECT",)},
    "leader": {Use.WORKER: _ALL, Use.ENQUEUE: (), Use.ADMIN: ("SELECT",)},
    # The operator pauses and limits queues (an upsert); a limited queue's claim updates
    # its rate window.
    "queues": {
        Use.WORKER: ("SELECT", "UPDATE"),
        Use.ENQUEUE: (),
        Use.ADMIN: ("SELECT", "INSERT", "UPDATE"),
    },
    # The operator pauses and resumes schedules (skiplock cron, migration 0030); run-now
    # enqueues into jobs.
    "periodic": {
        Use.WORKER: ("SELECT", "INSERT", "UPDATE"),
        Use.ENQUEUE: (),
        Use.ADMIN: ("SELECT", "UPDATE"),
    },
    # A windowed unique enqueue takes, re-takes and gives back its key; maintenance
    # deletes expired windows (worker and `skiplock prune`).
    "unique_windows": {Use.WORKER: _ALL, Use.ENQUEUE: _ALL, Use.ADMIN: ("SELECT", "DELETE")},
    "key_rates": {Use.WORKER: _ALL, Use.ENQUEUE: (), Use.ADMIN: ("SELECT", "DELETE")},
    # Workflows (0022): enqueued in one statement, read back by parent_results() and the
    # operator, cancelled by the operator. What ends steps writes them through the
    # SECURITY DEFINER functions below, so a worker needs no more.
    "workflows": {
        Use.WORKER: ("SELECT", "INSERT"),
        Use.ENQUEUE: ("SELECT", "INSERT"),
        Use.ADMIN: ("SELECT", "INSERT", "UPDATE"),
    },
    "workflow_steps": {
        Use.WORKER: ("SELECT", "INSERT"),
        Use.ENQUEUE: ("SELECT", "INSERT"),
        Use.ADMIN: ("SELECT", "INSERT"),
    },
    # Durable steps (0028): recorded by the worker's attempts, pruned with history; read by
    # `jobs show`.
    "job_steps": {
        Use.WORKER: ("SELECT", "INSERT", "DELETE"),
        Use.ENQUEUE: (),
        Use.ADMIN: ("SELECT", "DELETE"),
    },
    # Signals kept for a wait to come (0029): written by signal(), SECURITY DEFINER; a
    # worker's wait takes one, maintenance deletes the expired.
    "signals": {
        Use.WORKER: ("SELECT", "DELETE"),
        Use.ENQUEUE: (),
        Use.ADMIN: ("SELECT", "DELETE"),
    },
    # Every use checks that the schema is at the version it expects.
    "schema_migrations": {
        Use.WORKER: ("SELECT",),
        Use.ENQUEUE: ("SELECT",),
        Use.ADMIN: ("SELECT",),
    },
}

# Privileges a role may hold from an earlier release and must not keep: GRANT only adds,
# so these are revoked first (the table-wide INSERT on jobs, id included, that every use
# had before its columns were listed). Revoking a table's privilege revokes it on each of
# its columns too, so the GRANT that follows decides alone.
REVOKED: dict[str, tuple[str, ...]] = {"jobs": ("INSERT",)}

_EVERY_USE = frozenset(Use)

# Functions that are called (trigger functions are not: a trigger runs its function
# without checking EXECUTE). Keyed by name, with the identity arguments.
FUNCTIONS: dict[str, tuple[str, frozenset[Use]]] = {
    "history_partition_create": ("day date", frozenset({Use.WORKER, Use.ADMIN})),
    "history_partition_drop": ("day date", frozenset({Use.WORKER, Use.ADMIN})),
    # Admission (0015): the leader calls it, and so does the trigger of a DELETE of keyed
    # jobs (a completion, a cancel). SECURITY INVOKER, so EXECUTE also stays with PUBLIC:
    # the caller needs the table privileges anyway, and a DELETE by a role left out here
    # must not fail on its trigger.
    "keys_admit": (
        "wanted text[], at_most integer, wait boolean",
        frozenset({Use.WORKER, Use.ADMIN}),
    ),
    # Workflows (0022): called by the triggers of the statements that end steps (a
    # worker's outcome, a rescue, an operator's cancel, delete or retry). SECURITY
    # DEFINER, so not PUBLIC's.
    "workflow_steps_end": ("ended bigint[], outcomes text[]", frozenset({Use.WORKER, Use.ADMIN})),
    "workflow_step_retried": ("retried bigint", frozenset({Use.WORKER, Use.ADMIN})),
    # Waiting steps' rows locked before an operator's cancel or delete of their jobs
    # (0036): SECURITY DEFINER, it only locks.
    "workflow_steps_lock": ("ids bigint[]", frozenset({Use.WORKER, Use.ADMIN})),
    # A workflow from SQL (0023): SECURITY INVOKER, so PUBLIC keeps EXECUTE as well; the
    # caller's privileges on the tables decide.
    "enqueue_workflow": ("workflow jsonb", _EVERY_USE),
    # Batches (0024): SECURITY DEFINER, they change the counts of an open batch only.
    # batch_refuse only raises; it is called by the other two and keeps PUBLIC's EXECUTE.
    "batch_reserve": ("batch bigint, jobs integer", _EVERY_USE),
    "batch_close": ("batch bigint", _EVERY_USE),
    "batch_refuse": ("batch bigint, what text", _EVERY_USE),
    # Steps added at run time (0025): SECURITY DEFINER, fenced by the adder's attempt.
    "workflow_steps_reserve": (
        "adder bigint, attempt integer, names text[]",
        frozenset({Use.WORKER, Use.ADMIN}),
    ),
    # A unique enqueue that replaces its waiting holder (0031): SECURITY DEFINER, it
    # changes only the fields an enqueue writes, of waiting jobs with the key.
    "job_replace_waiting": (
        "active_key text, queued_key text, fields text[], new_args jsonb, "
        "new_run_at timestamp with time zone, new_priority smallint, new_max_attempts integer",
        _EVERY_USE,
    ),
    # The tags' statistics of a new history partition (0032): called only by
    # history_partition_create, as its owner; no use calls it.
    "tags_statistics_create": ("partition regclass", frozenset()),
    # A signal (0029): SECURITY DEFINER, so that a sender needs no privilege on jobs.
    "signal": ("signal_key text, signal_payload jsonb, kept_for interval", _EVERY_USE),
    # Ended workflows pruned with history (0026): by the leader and `skiplock prune`.
    "workflows_prune": (
        "ended_before timestamp with time zone, most integer",
        frozenset({Use.WORKER, Use.ADMIN}),
    ),
}


def statements(schema: str, role: str, use: Use) -> list[str]:
    """The GRANT statements for ``role`` to act as ``use`` on ``schema``, in order; pure."""
    validate_schema(schema)
    ident = sql.Identifier(schema)
    grantee = sql.Identifier(role)
    composed: list[sql.Composable] = [
        sql.SQL(grants.GRANT_SCHEMA_USAGE.strip()).format(schema=ident, role=grantee)
    ]
    for table, revoked in REVOKED.items():
        composed.append(
            sql.SQL(grants.REVOKE_TABLE.strip()).format(
                privileges=sql.SQL(", ").join(sql.SQL(p) for p in revoked),
                table=sql.Identifier(schema, table),
                role=grantee,
            )
        )
    for table, uses in TABLES.items():
        if uses[use]:
            composed.append(
                sql.SQL(grants.GRANT_TABLE.strip()).format(
                    privileges=sql.SQL(", ").join(sql.SQL(p) for p in uses[use]),
                    table=sql.Identifier(schema, table),
                    role=grantee,
                )
            )
    composed.append(sql.SQL(grants.GRANT_SEQUENCES.strip()).format(schema=ident, role=grantee))
    for name, (arguments, allowed) in FUNCTIONS.items():
        if use in allowed:
            composed.append(
                sql.SQL(grants.GRANT_FUNCTION.strip()).format(
                    function=sql.Composed(
                        [sql.Identifier(schema, name), sql.SQL(f"({arguments})")]
                    ),
                    role=grantee,
                )
            )
    return [statement.as_string(None) for statement in composed]


class GrantError(SkiplockError):
    """The connected role may not grant what a use needs; nothing was granted."""


def apply(conn: psycopg.Connection[Any], schema: str, role: str, use: Use) -> list[str]:
    """Run the statements in one transaction (all or none) and return them. ``conn`` must
    be the schema's owner's (or hold the privileges WITH GRANT OPTION)."""
    applied = statements(schema, role, use)
    try:
        check_schema_ready(conn, schema)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise GrantError(_refused(str(exc).strip(), schema)) from None
    # A GRANT (or REVOKE) by a role that holds a privilege without its grant option only
    # warns; a role left with part of what it needs (or with what it must not keep) would
    # fail later, far from here.
    partial: list[str] = []

    def collect(notice: psycopg.errors.Diagnostic) -> None:
        if notice.sqlstate in _WARNINGS_NOT_DONE:
            partial.append(notice.message_primary or "")

    conn.add_notice_handler(collect)
    try:
        with conn.transaction():
            for statement in applied:
                try:
                    conn.execute(statement)
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise GrantError(_refused(str(exc).strip(), schema)) from None
                except psycopg.errors.UndefinedObject as exc:
                    raise GrantError(
                        f"{str(exc).strip()}: create it first (CREATE ROLE ... LOGIN); "
                        "nothing was granted"
                    ) from None
                if partial:
                    raise GrantError(_refused(partial[0], schema))
    finally:
        conn.remove_notice_handler(collect)
    return applied


# SQLSTATE 01007: "no privileges were granted" / "not all privileges were granted";
# 01006: the same of a REVOKE ("no privileges could be revoked").
_WARNINGS_NOT_DONE = ("01007", "01006")


def _refused(reason: str, schema: str) -> str:
    return (
        f"{reason}; run `skiplock grant --apply` as the owner of schema {schema!r} "
        "(the role that runs `skiplock migrate`); nothing was granted"
    )
