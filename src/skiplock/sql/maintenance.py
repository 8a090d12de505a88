"""Rescuing jobs whose worker is gone, and keeping the worker registry current."""

# Liveness: every worker holds a session-level advisory lock keyed on its id on its
# always-open LISTEN connection. If this statement can take a worker's lock, that
# connection is gone, so the process is dead (or cut off): its running jobs go back at
# once instead of waiting out the lease. The try-lock is transaction-scoped and released
# at commit; a live worker's lock simply makes it return false.
WORKER_LOCK = """
SELECT pg_advisory_lock(hashtextextended(%(id)s::text, 0))
"""

JOB_RESCUE_ORPHANED = """
WITH owners AS (
    SELECT DISTINCT j.worker_id
    FROM {jobs} AS j
    WHERE j.state = 'running'
      AND NOT EXISTS (SELECT 1 FROM {workers} AS w WHERE w.id = j.worker_id AND NOT w.holds_lock)
), gone AS (
    SELECT worker_id FROM owners
    WHERE pg_try_advisory_xact_lock(hashtextextended(worker_id::text, 0))
)
UPDATE {jobs}
SET state = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'available' END,
    errors = errors || jsonb_build_array(jsonb_build_object(
        'attempt', attempts,
        'at', now(),
        'type', 'WorkerLost',
        'message', 'worker ' || worker_id::text || ' lost its connection; job rescued',
        'traceback', NULL)),
    worker_id = NULL,
    lease_expires_at = NULL
WHERE state = 'running' AND worker_id IN (SELECT worker_id FROM gone)
RETURNING id, queue
"""

# A lease that ran out means a hung, partitioned or dead worker. Give the job back (or park
# it as dead when it has no attempts left) and say why on the job. Fenced on the deadline
# itself, so a lease extended a moment ago is left alone.
JOB_RESCUE_EXPIRED = """
UPDATE {jobs}
SET state = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'available' END,
    errors = errors || jsonb_build_array(jsonb_build_object(
        'attempt', attempts,
        'at', now(),
        'type', 'LeaseExpired',
        'message', 'lease expired on worker ' || worker_id::text || '; job rescued',
        'traceback', NULL)),
    worker_id = NULL,
    lease_expires_at = NULL
WHERE state = 'running' AND lease_expires_at < now()
RETURNING id, queue
"""

# Scheduled and retryable jobs whose time has come join the claim index. SKIP LOCKED lets
# several promoters run at once without waiting on each other; each queue that received
# jobs is woken in the same statement.
JOB_PROMOTE_DUE = """
WITH due AS (
    SELECT id
    FROM {jobs}
    WHERE state IN ('scheduled', 'retryable') AND run_at <= now()
    ORDER BY run_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), promoted AS (
    UPDATE {jobs} AS j
    SET state = 'available'
    FROM due
    WHERE j.id = due.id
    RETURNING j.queue
)
SELECT queue, count(*), pg_notify(%(channel)s, queue)
FROM promoted
GROUP BY queue
"""

# Seconds until the next waiting job comes due (on the database's clock), so the
# promoter can sleep exactly until then. NULL when nothing waits.
JOB_NEXT_DUE = """
SELECT extract(epoch FROM min(run_at) - now())::float8
FROM {jobs} WHERE state IN ('scheduled', 'retryable')
"""

WORKER_REGISTER = """
INSERT INTO {workers} (id, host, pid, queues, concurrency, holds_lock)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(holds_lock)s)
ON CONFLICT (id) DO UPDATE SET last_seen_at = now()
"""

WORKER_TOUCH = """
UPDATE {workers} SET last_seen_at = now() WHERE id = %(id)s
"""

WORKER_DEREGISTER = """
DELETE FROM {workers} WHERE id = %(id)s
"""
