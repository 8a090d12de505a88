"""Reading and steering jobs by hand: the CLI's and operators' statements."""

from skiplock.sql.maintenance import NOTIFY_MOVED

JOB_GET = """
SELECT id, queue, task, args, state, priority, run_at, retry_at, attempts, max_attempts,
       errors, worker_id, lease_expires_at, created_at, attempted_at,
       NULL::timestamptz AS finished_at, NULL::jsonb AS result, progress,
       cancel_requested_at, wait_key, wait_until, meta -> 'tags' AS tags
FROM {jobs} WHERE id = %(id)s
UNION ALL
SELECT id, queue, task, args, state, priority, NULL, NULL, attempts, max_attempts,
       errors, NULL, NULL, created_at, attempted_at, finished_at, result, progress, NULL,
       NULL, NULL, meta -> 'tags'
FROM {history} WHERE id = %(id)s
LIMIT 1
"""

# The filters of the CLI's listings (JOB_LIST, JOB_SELECT_IDS); a NULL one is left out.
_JOB_FILTERS = """
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(task)s::text IS NULL OR task = %(task)s)
  AND (%(older_than)s::float8 IS NULL
       OR created_at < now() - %(older_than)s * interval '1 second')
  AND (%(tag)s::text IS NULL
       OR (meta ? 'tags' AND meta -> 'tags' @> %(tag_json)s::jsonb))
"""

JOB_LIST = (
    """
SELECT id, queue, task, args, state, priority, run_at, retry_at, attempts, max_attempts,
       errors, worker_id, lease_expires_at, created_at, attempted_at,
       NULL::timestamptz AS finished_at, NULL::jsonb AS result, progress,
       cancel_requested_at, wait_key, wait_until, meta -> 'tags' AS tags
FROM {jobs}"""
    + _JOB_FILTERS
    + """ORDER BY id
LIMIT %(limit)s
"""
)

# A dead (or waiting) job goes back to the queue with a fresh set of attempts; its errors
# are kept so the history of what went wrong survives the retry. A cancel request left on
# the row (asked for while an earlier attempt ran, which then failed) is cleared: retrying
# by hand is the newer decision, and the request would cancel the new attempt at its
# first heartbeat. The insert trigger does
# not fire on update, so the statement wakes the queue itself.
JOB_RETRY = (
    """
WITH moved AS (
    UPDATE {jobs}
    -- A dead keyed job joins its key's line again (admission lets it run when there is
    -- room; being the oldest, it goes first); keyed jobs still admitted keep their place.
    SET state = CASE WHEN ordering_key IS NOT NULL AND state = 'dead' THEN 'blocked'
                     ELSE 'available' END,
        retry_at = now(), attempts = 0, worker_id = NULL,
        run_at = least(run_at, now()),
        lease_expires_at = NULL,
        cancel_requested_at = NULL,
        -- A dead job held no key; if a live job holds it now (or a job retried in this
        -- same call takes it first), this one runs without. A queued-scope key stays with
        -- a job that never started (scheduled, available: it holds the key now); one that
        -- has started (dead, retryable) gave it up for good.
        unique_key = CASE WHEN EXISTS (
            SELECT 1 FROM {jobs} AS other
            WHERE other.unique_key = {jobs}.unique_key AND other.id <> {jobs}.id
              AND (other.state <> 'dead'
                   OR (other.id = ANY(%(ids)s::bigint[]) AND other.id < {jobs}.id)))
            THEN NULL ELSE unique_key END,
        unique_queued_key = CASE WHEN state IN ('scheduled', 'available')
                                 THEN unique_queued_key END
    WHERE id = ANY(%(ids)s::bigint[])
      AND state IN ('dead', 'retryable', 'scheduled', 'available')
    RETURNING queue, priority, run_at
)"""
    + NOTIFY_MOVED
)

# Before a cancel or a delete of waiting jobs: the step rows of those that are workflow
# steps, locked in the order a parent's completion takes them (migration 0036).
WORKFLOW_STEPS_LOCK = "SELECT {schema}.workflow_steps_lock(%(ids)s::bigint[])"

JOB_CANCEL_WAITING = """
WITH gone AS (
    DELETE FROM {jobs}
    WHERE id = ANY(%(ids)s::bigint[])
      AND state IN ('waiting', 'blocked', 'scheduled', 'available', 'retryable', 'dead')
    RETURNING *
)
INSERT INTO {history} (id, queue, task, args, state, priority, attempts, max_attempts, errors,
                       result, unique_key, ordering_key, created_at, attempted_at, progress,
                       started_at, worker_ids, meta)
SELECT id, queue, task, args, 'cancelled', priority, attempts, max_attempts, errors,
       NULL, unique_key, ordering_key, created_at, attempted_at, progress, started_at,
       worker_ids, meta
FROM gone
RETURNING id
"""

# Ask the worker running a lease-mode job to stop it. Recorded on the row (heartbeats
# carry it to the worker if the notification is missed) and announced on the control
# channel; the worker writes the cancelled outcome.
JOB_CANCEL_RUNNING = """
WITH asked AS (
    UPDATE {jobs} SET cancel_requested_at = coalesce(cancel_requested_at, now())
    WHERE id = ANY(%(ids)s::bigint[]) AND state = 'running'
    RETURNING id
)
SELECT id, pg_notify(%(channel)s, 'cancel' || E'\\t' || id) FROM asked
"""

# Gone for good: no history row. Running jobs are refused (cancel them first).
JOB_DELETE = """
DELETE FROM {jobs}
WHERE id = ANY(%(ids)s::bigint[]) AND state <> 'running'
RETURNING id
"""

# Ids for the bulk forms of retry, cancel and delete: the same filters as JOB_LIST.
JOB_SELECT_IDS = (
    """
SELECT id FROM {jobs}"""
    + _JOB_FILTERS
    + """ORDER BY id
"""
)

# The states of history a job can be run again from (replayed): it ended as asked.
REPLAYABLE_STATES = ("completed", "cancelled")

# A finished job run again by hand (`jobs retry` on a completed or cancelled job): history
# keeps the original as it ended; the copy is a new job, enqueued as any other (its key's
# line joined, its queue woken), whose meta names the original (replay_of). A unique key
# is not copied: the replay is asked for by name, and runs even if a live job holds it.
# Its tags are.
JOB_REPLAYABLE = """
SELECT id, queue, task, args::text, priority, max_attempts, ordering_key,
       CASE WHEN jsonb_typeof(meta -> 'tags') = 'array' THEN meta -> 'tags' END
FROM {history}
WHERE id = ANY(%(ids)s::bigint[]) AND state IN ('completed', 'cancelled')
ORDER BY id
"""

# The finished jobs a replay by filter runs again (a state of REPLAYABLE_STATES given).
JOB_SELECT_REPLAYABLE_IDS = (
    """
SELECT id FROM {history}"""
    + _JOB_FILTERS
    + """  AND state IN ('completed', 'cancelled')
ORDER BY id
"""
)

# Pausing is checked inside the claim statement, so it takes effect for the next claim.
# Resuming wakes the queue's workers in the usual payload format.
QUEUE_SET_PAUSED = """
INSERT INTO {queues} (name, paused) VALUES (%(queue)s, %(paused)s)
ON CONFLICT (name) DO UPDATE SET paused = EXCLUDED.paused, updated_at = now()
"""

QUEUE_WAKE = """
SELECT pg_notify(%(channel)s, %(queue)s || E'\\t' || min(priority) || E'\\t'
                              || extract(epoch FROM min(run_at)))
FROM {jobs} WHERE queue = %(queue)s AND state = 'available'
HAVING count(*) > 0
"""

QUEUE_LIST_PAUSED = """
SELECT name FROM {queues} WHERE paused ORDER BY name
"""

# Limits are read by the claims of the queue's workers; the control message makes them
# re-read at once (they also re-read every few seconds).
QUEUE_SET_LIMITS = """
INSERT INTO {queues} (name, concurrency_limit, rate_limit, rate_period)
VALUES (%(queue)s, %(concurrency)s, %(rate)s, %(period)s)
ON CONFLICT (name) DO UPDATE
SET concurrency_limit = EXCLUDED.concurrency_limit,
    rate_limit = EXCLUDED.rate_limit,
    rate_period = EXCLUDED.rate_period,
    rate_window = '{{}}',
    updated_at = now()
"""

QUEUE_LIMITS_CHANGED = """
SELECT pg_notify(%(channel)s, 'limits')
"""

QUEUE_LIST = """
SELECT name, paused, concurrency_limit, rate_limit, rate_period FROM {queues} ORDER BY name
"""

# Live jobs per queue and state, and the age of the oldest ready one (from when it became
# due: its retry_at after a failure, including due jobs the promoter has not moved yet).
# Shared by `skiplock status` (QUEUE_STATS) and the dashboard's overview. Ages are
# differences of epochs, not intervals: a run_at of '-infinity' (a row written by hand)
# gives an infinite age, where PostgreSQL before 17 cannot subtract it and fails the read.
LIVE_QUEUE_COUNTS = """
    SELECT queue,
           count(*) FILTER (WHERE state = 'waiting') AS waiting,
           count(*) FILTER (WHERE state = 'blocked') AS blocked,
           count(*) FILTER (WHERE state = 'available') AS available,
           count(*) FILTER (WHERE state = 'scheduled') AS scheduled,
           count(*) FILTER (WHERE state = 'running') AS running,
           count(*) FILTER (WHERE state = 'retryable') AS retryable,
           count(*) FILTER (WHERE state = 'dead') AS dead,
           (extract(epoch FROM now()) - extract(epoch FROM min(greatest(run_at, retry_at))
               FILTER (WHERE state IN ('available', 'scheduled', 'retryable')
                         AND greatest(run_at, retry_at) <= now())))::float8
               AS oldest_ready_seconds
    FROM {jobs}
    GROUP BY queue
"""

# Registered workers per queue they serve, shared like LIVE_QUEUE_COUNTS. A NULL in a
# worker's queues (a row written by hand) serves no queue.
SERVING_WORKERS = """
    SELECT q AS queue, count(*) AS workers
    FROM {workers}, unnest(queues) AS q
    WHERE q IS NOT NULL
    GROUP BY q
"""

# The columns of LIVE_QUEUE_COUNTS as read from ``live AS l`` beside other per-queue
# figures: a queue that only those know of (no live jobs) counts zeros, not NULLs.
LIVE_QUEUE_COLUMNS = """
       coalesce(l.waiting, 0) AS waiting,
       coalesce(l.blocked, 0) AS blocked,
       coalesce(l.available, 0) AS available,
       coalesce(l.scheduled, 0) AS scheduled,
       coalesce(l.running, 0) AS running,
       coalesce(l.retryable, 0) AS retryable,
       coalesce(l.dead, 0) AS dead,
       l.oldest_ready_seconds,"""

# Monitoring figures per queue: LIVE_QUEUE_COUNTS with the last minute's. Failures in the
# last minute are the error records stamped in it, on live jobs attempted
# in that minute and on jobs finished in it.
QUEUE_STATS = (
    """
WITH live AS (
"""
    + LIVE_QUEUE_COUNTS
    + """), recent AS (
    SELECT queue, errors, false AS finished FROM {jobs}
    WHERE attempted_at > now() - interval '1 minute'
    UNION ALL
    SELECT queue, errors, state = 'completed' FROM {history}
    WHERE finished_at > now() - interval '1 minute'
), minute AS (
    SELECT queue,
           count(*) FILTER (WHERE finished) AS completed_last_minute,
           coalesce(sum((SELECT count(*) FROM jsonb_array_elements(errors) AS e
                         WHERE (e ->> 'at')::timestamptz > now() - interval '1 minute')), 0)
               AS failed_last_minute
    FROM recent
    GROUP BY queue
), serving AS (
"""
    + SERVING_WORKERS
    + """
)
SELECT queue,"""
    + LIVE_QUEUE_COLUMNS
    + """
       coalesce(m.completed_last_minute, 0) AS completed_last_minute,
       coalesce(m.failed_last_minute, 0)::bigint AS failed_last_minute,
       coalesce(s.workers, 0) AS workers
FROM live AS l
FULL JOIN minute AS m USING (queue)
FULL JOIN serving AS s USING (queue)
ORDER BY queue
"""
)

# Who is working: one row per registered worker process.
WORKER_LIST = """
SELECT id, host, pid, queues, concurrency, holds_lock, started_at, service_restarts,
       (extract(epoch FROM now()) - extract(epoch FROM last_seen_at))::float8
           AS last_seen_seconds,
       EXISTS (SELECT 1 FROM {leader} AS l
               WHERE l.worker_id = w.id AND l.expires_at > now()) AS leader
FROM {workers} AS w
ORDER BY host, pid
"""
