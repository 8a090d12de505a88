"""Reading from a standby: whether the server is one, and how far behind it is."""

# How long ago the last transaction a standby replayed committed on the primary; 0 when it
# has replayed everything it received, since an idle primary sends nothing and the age of
# the last replayed commit would otherwise grow as if the standby fell behind. NULL on a
# primary, and on a standby that has replayed nothing yet.
REPLICA_LAG = """
SELECT pg_is_in_recovery() AS standby,
       CASE
           WHEN NOT pg_is_in_recovery() THEN NULL
           WHEN pg_last_wal_receive_lsn() IS NOT NULL
                AND pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0.0
           ELSE extract(epoch FROM now() - pg_last_xact_replay_timestamp())::float8
       END AS lag_seconds
"""

# admin.WORKER_LIST for a hot standby: the leader table is unlogged, so a standby has none
# to read (PostgreSQL refuses to open it during recovery) and the leader is unknown there.
# The age is a difference of epochs, not an interval: an infinite last_seen_at (a row
# written by hand) gives an infinite age, where PostgreSQL before 17 cannot subtract it.
WORKER_LIST_ON_STANDBY = """
SELECT id, host, pid, queues, concurrency, holds_lock, started_at, service_restarts,
       (extract(epoch FROM now()) - extract(epoch FROM last_seen_at))::float8
           AS last_seen_seconds,
       NULL::boolean AS leader
FROM {workers} AS w
ORDER BY host, pid
"""
