"""Durable waits, sleeps and signals (0029). A wait or a sleep ends its attempt in one
fenced statement: the job leaves the worker (no lease, no slot, no connection) and its
attempt is given back, as a snooze's is; the answer it will resume with is a step record
(sql/steps.py). Signals are sent by the schema's signal() function (the migration)."""

from skiplock.sql.maintenance import NOTIFY_MOVED

# A signal and a wait for one key take this lock first (as signal() does), in a statement
# of their own: the next statement's snapshot then sees what the other committed.
SIGNAL_KEY_LOCK = """
SELECT pg_advisory_xact_lock(hashtextextended(%(lock)s, 0))
"""

# The attempt waits for %(key)s, fenced (the row locked first, and the fence again in the
# write's own WHERE: a rescue committed while this waited for the lock must win). If a
# signal for the key is kept, the oldest is taken, recorded as the wait's answer, and the
# attempt goes on (its payload comes back);
# otherwise the job waits, until a signal or %(seconds)s (NULL: no limit). The row comes
# back with whether the attempt held its job, the payload taken, and whether it now waits.
JOB_WAIT_IF_HELD = """
WITH held AS (
    SELECT j.id FROM {jobs} AS j
    WHERE j.id = %(id)s AND j.attempts = %(attempt)s AND j.worker_id = %(worker_id)s
    FOR UPDATE
), kept AS (
    DELETE FROM {signals} AS s
    WHERE s.id = (SELECT k.id FROM {signals} AS k
                  WHERE k.key = %(key)s AND k.expires_at > now()
                    AND EXISTS (SELECT FROM held)
                  ORDER BY k.id
                  LIMIT 1
                  FOR UPDATE SKIP LOCKED)
    RETURNING s.payload
), recorded AS (
    INSERT INTO {job_steps} (job_id, name, attempt, result)
    SELECT %(id)s, %(step)s, %(attempt)s, jsonb_build_object('signal', k.payload)
    FROM kept AS k
    ON CONFLICT (job_id, name) DO NOTHING
), parked AS (
    UPDATE {jobs} AS j
    SET state = 'waiting',
        wait_key = %(key)s,
        wait_step = %(step)s,
        wait_until = now() + %(seconds)s::float8 * interval '1 second',
        run_at = now(),
        retry_at = NULL,
        attempts = j.attempts - 1,
        worker_id = NULL,
        lease_expires_at = NULL
    WHERE j.id = %(id)s AND j.attempts = %(attempt)s AND j.worker_id = %(worker_id)s
      AND EXISTS (SELECT FROM held) AND NOT EXISTS (SELECT FROM kept)
    RETURNING j.id
)
SELECT EXISTS (SELECT FROM held), (SELECT payload::text FROM kept), EXISTS (SELECT FROM parked)
"""

# The attempt sleeps %(seconds)s, fenced: the job is due again then (on the database's
# clock), and the sleep is recorded as done, so that the attempt that resumes goes on.
# A row comes back when the attempt held its job.
JOB_SLEEP_IF_HELD = """
WITH parked AS (
    UPDATE {jobs} AS j
    SET state = 'scheduled',
        run_at = now() + %(seconds)s::float8 * interval '1 second',
        retry_at = NULL,
        attempts = j.attempts - 1,
        worker_id = NULL,
        lease_expires_at = NULL
    WHERE j.id = %(id)s AND j.attempts = %(attempt)s AND j.worker_id = %(worker_id)s
    RETURNING j.id, j.run_at
), recorded AS (
    INSERT INTO {job_steps} (job_id, name, attempt, result)
    SELECT id, %(step)s, %(attempt)s, jsonb_build_object('until', run_at) FROM parked
    ON CONFLICT (job_id, name) DO NOTHING
)
SELECT id FROM parked
"""

# Waits whose time is up: their answer is recorded as a timeout and they become
# available, at their place in line (the notification rewinds claim cursors to it).
JOB_WAITS_TIMED_OUT = (
    """
WITH due AS (
    SELECT id, attempts, wait_step
    FROM {jobs}
    WHERE wait_until <= now()
    ORDER BY wait_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), recorded AS (
    INSERT INTO {job_steps} (job_id, name, attempt, result)
    SELECT id, wait_step, attempts, jsonb_build_object('timeout', true) FROM due
    ON CONFLICT (job_id, name) DO NOTHING
), moved AS (
    UPDATE {jobs} AS j
    SET state = 'available', wait_key = NULL, wait_step = NULL, wait_until = NULL
    WHERE j.id = ANY(ARRAY(SELECT id FROM due))
    RETURNING j.queue, j.priority, j.run_at
)"""
    + NOTIFY_MOVED
)

# A signal, from Python: the schema's signal() (the same function plain SQL calls).
SIGNAL_SEND = """
SELECT {schema}.signal(%(key)s, %(payload)s::jsonb, %(kept_for)s::float8 * interval '1 second')
"""

# Maintenance: signals no wait took before they expired, a batch at a time.
SIGNALS_PRUNE = """
DELETE FROM {signals}
WHERE id IN (SELECT id FROM {signals} WHERE expires_at < now() LIMIT %(limit)s)
"""

# What waits: for `status`, the waits and the signals kept.
SIGNALS_COUNT = """
SELECT (SELECT count(*) FROM {jobs} WHERE wait_key IS NOT NULL),
       (SELECT count(*) FROM {signals} WHERE expires_at > now())
"""
