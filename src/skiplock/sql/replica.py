"""Reading from a standby: whether the server is one, and how far behind it is."""

# Whether the server is a standby, whether it streams from its primary, and how far
# behind it is. Streaming means a WAL receiver is there (pg_stat_wal_receiver has its row;
# a role without pg_read_all_stats sees its pid but not its status) and, when the status
# shows, 'streaming'. The lag of a streaming standby is how long ago the last transaction
# it replayed committed on the primary, or 0 when it has replayed everything it received:
# an idle primary sends nothing, and the age of the last replayed commit would otherwise
# grow as if the standby fell behind. A standby that does not stream (its primary gone,
# replication broken) has replayed all it received too, but that says nothing about the
# primary: its lag is the age of its last replayed commit, which it shows the primary as
# of. NULL on a primary, and on a standby that has replayed nothing yet.
REPLICA_LAG = """
WITH receiver AS (
    SELECT pid, status FROM pg_stat_wal_receiver LIMIT 1
), facts AS (
    SELECT pg_is_in_recovery() AS standby,
           EXISTS (SELECT FROM receiver WHERE status IS NULL OR status = 'streaming')
               AS streaming,
           (SELECT status FROM receiver) AS receiver_status,
           pg_last_xact_replay_timestamp() AS last_replay_at
)
SELECT standby,
       CASE
           WHEN NOT standby THEN NULL
           WHEN streaming
                AND pg_last_wal_receive_lsn() IS NOT NULL
                AND pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0.0
           ELSE extract(epoch FROM now() - last_replay_at)::float8
       END AS lag_seconds,
       standby AND streaming AS streaming,
       receiver_status,
       last_replay_at
FROM facts
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
