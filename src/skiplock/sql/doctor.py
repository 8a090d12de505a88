"""The queries behind ``skiplock doctor``; each is also usable on its own (see
docs/operations.md)."""

# Per-table autovacuum switch and dead tuples of skiplock's tables.
DOCTOR_TABLES = """
SELECT c.relname,
       coalesce((SELECT NOT option_value::boolean FROM pg_options_to_table(c.reloptions)
                 WHERE option_name = 'autovacuum_enabled'), false) AS autovacuum_disabled,
       s.n_live_tup, s.n_dead_tup, s.last_autovacuum, s.last_vacuum
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE n.nspname = %(schema)s AND c.relname IN ('jobs', 'workers', 'leader')
ORDER BY c.relname
"""

DOCTOR_AUTOVACUUM = """
SELECT current_setting('autovacuum')
"""

# The session holding back VACUUM the longest in this database, among transactions open
# longer than the limit: by its snapshot (xmin), or by its own transaction id (a session
# that wrote and sat idle in its transaction has one and no snapshot). Every snapshot
# taken while such a writer is open starts at its xid, so busy sessions tie with it on
# the horizon: the session whose own xid it is comes first, then the oldest transaction.
DOCTOR_OLDEST_XMIN = """
SELECT pid, usename, application_name, state,
       extract(epoch FROM now() - xact_start)::float8 AS xact_seconds,
       greatest(age(backend_xmin), age(backend_xid)) AS xmin_age, left(query, 120) AS query,
       backend_xid IS NOT NULL AS wrote, backend_xmin IS NOT NULL AS has_snapshot
FROM pg_stat_activity
WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
  AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
  AND xact_start < now() - %(limit)s * interval '1 second'
  AND datname = current_database()
ORDER BY greatest(age(backend_xmin), age(backend_xid)) DESC,
         age(backend_xid) DESC NULLS LAST, xact_start
LIMIT 1
"""

DOCTOR_PREPARED_AND_SLOTS = """
SELECT (SELECT count(*) FROM pg_prepared_xacts) AS prepared,
       (SELECT count(*) FROM pg_replication_slots
        WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL) AS slots_holding_xmin
"""

DOCTOR_NOTIFY_QUEUE = """
SELECT pg_notification_queue_usage()
"""

# Listening sessions (a listener that never reads makes the notification queue grow).
# Which channels a session listens on is visible to that session alone
# (pg_listening_channels), so a worker's listener is found by the application_name it
# connects with (worker/liveness.py, session_name). A session whose last statement was a
# LISTEN is counted too: another program's listener, or a worker's whose URL sets its own
# application_name and that has not run anything since.
DOCTOR_LISTENERS = """
WITH listening AS (
    SELECT state, state_change FROM pg_stat_activity
    WHERE datname = current_database()
      AND (application_name LIKE 'skiplock listener %%' OR query ILIKE 'LISTEN%%')
)
SELECT count(*) AS listeners,
       max(extract(epoch FROM now() - state_change)) FILTER (
           WHERE state = 'idle in transaction')::float8 AS stuck_seconds
FROM listening
"""

# Queues with ready jobs, whether each is paused, and how many live workers serve it. A
# worker is live while one of its sessions holds the shared advisory lock on its key
# (maintenance.WORKER_LOCK; pg_locks shows a bigint key as its high and low 32 bits), or,
# for a lease-only worker, while it checks in. A registration alone proves nothing: a
# killed worker's row stays until a leader's rescuer removes it, and with every worker
# dead there is no leader.
DOCTOR_QUEUES_WAITING = """
WITH ready AS (
    SELECT queue, count(*) AS ready FROM {jobs} WHERE state = 'available' GROUP BY queue
), live AS (
    SELECT w.queues FROM {workers} AS w
    WHERE CASE WHEN w.holds_lock THEN EXISTS (
        SELECT 1 FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid::bigint = (hashtextextended(w.id::text, 0) >> 32) & 4294967295
          AND l.objid::bigint = hashtextextended(w.id::text, 0) & 4294967295)
    ELSE w.last_seen_at > now() - %(stale)s * interval '1 second' END
)
SELECT r.queue, r.ready, coalesce(q.paused, false) AS paused,
       (SELECT count(*) FROM live WHERE r.queue = ANY(live.queues)) AS serving,
       (SELECT count(*) FROM live) AS live_workers
FROM ready AS r
LEFT JOIN {queues} AS q ON q.name = r.queue
ORDER BY r.queue
"""

DOCTOR_STALE_WORKERS = """
SELECT count(*),
       count(*) FILTER (WHERE last_seen_at < now() - %(stale)s * interval '1 second')
FROM {workers}
"""

# Dead jobs wait in the jobs table for a human: a count per queue, and when the latest
# of them was last tried.
DOCTOR_DEAD_JOBS = """
SELECT queue, count(*), extract(epoch FROM now() - max(attempted_at))::float8
FROM {jobs} WHERE state = 'dead'
GROUP BY queue ORDER BY queue
"""

DOCTOR_INVALID_INDEXES = """
SELECT c.relname
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND NOT i.indisvalid
"""

DOCTOR_INDEX_SIZES = """
SELECT c.relname, pg_relation_size(c.oid) AS bytes
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname IN ('jobs_claim', 'jobs_running', 'jobs_waiting')
"""

DOCTOR_JOBS_LIVE = """
SELECT count(*) FROM {jobs}
"""

DOCTOR_HISTORY_DEFAULT_ROWS = """
SELECT count(*) FROM {history_default}
"""

# Transactional-mode jobs hold a row lock (FOR UPDATE) on jobs for as long as they run.
DOCTOR_LONG_TRANSACTIONAL = """
SELECT a.pid, extract(epoch FROM now() - a.xact_start)::float8 AS seconds,
       a.application_name
FROM pg_locks AS l
JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.relation = %(jobs)s::regclass AND l.mode = 'RowShareLock'
  AND a.xact_start < now() - %(limit)s * interval '1 second'
ORDER BY a.xact_start
"""
