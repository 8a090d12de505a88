"""History retention: daily partitions created ahead, dropped when expired; the DEFAULT
partition (rows that arrived before their partition existed) pruned in batches.

Partition DDL (through the owner's functions of 0012) takes a strong lock on job_history.
It runs with a short lock_timeout, so that waiting behind a long transaction can never
make completions queue behind it; maintenance simply tries again next time.
"""

# Partitions of job_history. Their day is in their name (job_history_pYYYYMMDD, as
# created by the migration and by maintenance); others are left alone.
HISTORY_PARTITIONS = """
SELECT c.relname
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = %(history)s::regclass
ORDER BY c.relname
"""

HISTORY_LOCK_TIMEOUT = """
SELECT set_config('lock_timeout', %(ms)s, true)
"""

# Partition DDL needs job_history's owner; these functions of the owner (0012) run it
# for whoever was granted EXECUTE, so a worker role that owns nothing keeps history too.
# The partition of a day is named and bounded by the function, never by the caller.
HISTORY_PARTITION_CREATE = """
SELECT {schema}.history_partition_create(%(day)s::date)
"""

HISTORY_PARTITION_DROP = """
SELECT {schema}.history_partition_drop(%(day)s::date)
"""

# The fallback for rows in the DEFAULT partition: a bounded batch per transaction, so a
# large backlog never becomes one long-running delete.
HISTORY_PRUNE_DEFAULT_BATCH = """
DELETE FROM {history_default}
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {history_default}
    WHERE finished_at < %(now)s::timestamptz - %(retention)s * interval '1 second'
    LIMIT %(batch)s))
"""

# Windowed unique keys whose window has passed (0009): free already, deleted in batches so
# the table holds only windows still running. The expiry is tested again on the row being
# deleted: an enqueue may re-take a key (ON CONFLICT DO UPDATE) after the batch was read,
# and the delete, waiting on that row, then rechecks its WHERE against the new version,
# which must not go.
# Ended workflows and their steps' rows, a batch at a time (0026's function: the worker's
# role may not delete them itself).
WORKFLOWS_PRUNE_BATCH = "SELECT {schema}.workflows_prune(%(ended_before)s, %(batch)s)"

UNIQUE_WINDOWS_PRUNE_BATCH = """
DELETE FROM {unique_windows}
WHERE key = ANY(ARRAY(
    SELECT key FROM {unique_windows} WHERE expires_at <= now() LIMIT %(batch)s))
  AND expires_at <= now()
"""
