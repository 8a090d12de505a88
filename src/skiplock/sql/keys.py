"""Admitting keyed jobs: the only writer that turns 'blocked' into runnable (0008).

Admission runs in its own short transaction: ADMIT_LOCK first, then ADMIT as a separate
statement, so its snapshot is taken after the lock is held and sees everything the
previous admission committed. Two admitters (a leader and one that has not yet noticed it
lost) therefore never admit past a key's limit between them.
"""

from skiplock.sql.maintenance import NOTIFY_MOVED

ADMIT_LOCK = """
SELECT pg_advisory_xact_lock(hashtextextended(%(lock)s, 0))
"""

# For each key asked about (ADMIT_ALL: every key with waiting jobs), the
# oldest waiting job's limits apply: room is its concurrency limit minus the key's
# admitted jobs and, with a rate, the rate minus the admissions logged within the period.
# That many of the key's oldest waiting jobs become scheduled or available, and their
# admission times are logged for rate-limited keys. statement_timestamp(): this
# statement starts after the lock is held. A job retried by hand may carry a retry_at
# from before; it runs at once when admitted.
_ASKED_KEYS = """
WITH asked AS (
    -- Key by key, each an equality on the index of waiting jobs. LATERAL ... LIMIT 1 so
    -- that no plan can turn it into a join that walks the whole index (see
    -- ROBUST_LOOKUP in sql/complete.py).
    SELECT DISTINCT k AS key
    FROM unnest(%(keys)s::text[]) AS k,
         LATERAL (SELECT 1 FROM {jobs}
                  WHERE ordering_key = k AND state = 'blocked' LIMIT 1) AS waiting
"""

_ASKED_ALL = """
WITH asked AS (
    SELECT DISTINCT ordering_key AS key FROM {jobs} WHERE state = 'blocked'
"""

_ADMIT = (
    """
), head AS (
    SELECT asked.key, oldest.key_limit, oldest.key_rate, oldest.key_period
    FROM asked,
         LATERAL (SELECT key_limit, key_rate, key_period FROM {jobs}
                  WHERE ordering_key = asked.key AND state = 'blocked'
                  ORDER BY id LIMIT 1) AS oldest
), room AS (
    SELECT head.key, head.key_rate, head.key_period,
           least(
               head.key_limit
               - (SELECT count(*) FROM {jobs}
                  WHERE ordering_key = head.key
                    AND state IN ('scheduled', 'available', 'running', 'retryable')),
               head.key_rate
               - (SELECT count(*) FROM {key_rates} AS r, unnest(r.admissions) AS t
                  WHERE r.key = head.key
                    AND t > statement_timestamp() - head.key_period * interval '1 second')
           ) AS free
    FROM head
), picked AS (
    SELECT next.id
    FROM room,
         LATERAL (SELECT id FROM {jobs}
                  WHERE ordering_key = room.key AND state = 'blocked'
                  ORDER BY id
                  LIMIT room.free) AS next
    WHERE room.free > 0
), moved AS (
    UPDATE {jobs} AS j
    SET state = CASE WHEN j.run_at > now() THEN 'scheduled' ELSE 'available' END,
        retry_at = NULL
    -- Picked as blocked in this statement's snapshot, under the admission lock: only a
    -- cancel or delete can touch such a row meanwhile, and then it is gone. (No state
    -- test here: it would let the planner walk the index of waiting jobs instead.)
    WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING j.queue, j.priority, j.run_at, j.ordering_key
), logged AS (
    INSERT INTO {key_rates} AS r (key, period, admissions)
    SELECT room.key, room.key_period, array_fill(statement_timestamp(), ARRAY[count(*)::int])
    FROM moved JOIN room ON room.key = moved.ordering_key
    WHERE room.key_rate IS NOT NULL
    GROUP BY room.key, room.key_period
    ON CONFLICT (key) DO UPDATE
    SET period = EXCLUDED.period,
        admissions = ARRAY(
            SELECT t FROM unnest(r.admissions) AS t
            WHERE t > statement_timestamp() - EXCLUDED.period * interval '1 second'
            ORDER BY t) || EXCLUDED.admissions
)"""
    + NOTIFY_MOVED
)

ADMIT = _ASKED_KEYS + _ADMIT
# The periodic full pass: the same for every key with waiting jobs.
ADMIT_ALL = _ASKED_ALL + _ADMIT

# Rate-limited keys that still have waiting jobs, and in how many seconds the oldest
# admission in each one's window leaves it (room for one more). The leader comes back
# for them then.
KEY_RATE_NEXT = """
SELECT r.key,
       extract(epoch FROM min(t) + r.period * interval '1 second' - statement_timestamp())
FROM {key_rates} AS r, unnest(r.admissions) AS t
WHERE t > statement_timestamp() - r.period * interval '1 second'
  AND EXISTS (SELECT 1 FROM {jobs} WHERE ordering_key = r.key AND state = 'blocked')
GROUP BY r.key, r.period
"""

# Logs of keys whose window has emptied and that have nothing waiting.
KEY_RATES_PRUNE = """
DELETE FROM {key_rates} AS r
WHERE NOT EXISTS (SELECT 1 FROM unnest(r.admissions) AS t
                  WHERE t > now() - r.period * interval '1 second')
  AND NOT EXISTS (SELECT 1 FROM {jobs} WHERE ordering_key = r.key AND state = 'blocked')
"""

# Is anything waiting at all? The periodic full pass is skipped when not.
ANY_WAITING = """
SELECT EXISTS (SELECT 1 FROM {jobs} WHERE state = 'blocked')
"""
