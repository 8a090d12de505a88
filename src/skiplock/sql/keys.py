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

# For each key asked about (every key with waiting jobs when %(keys)s is NULL): room is
# the limit of its oldest waiting job minus its admitted jobs; that many of its oldest
# waiting jobs become scheduled or available. A job retried by hand may carry a retry_at
# from before; it runs at once when admitted.
ADMIT = (
    """
WITH asked AS (
    SELECT DISTINCT ordering_key AS key
    FROM {jobs}
    WHERE state = 'blocked'
      AND (%(keys)s::text[] IS NULL OR ordering_key = ANY(%(keys)s::text[]))
), room AS (
    SELECT asked.key,
           (SELECT key_limit FROM {jobs}
            WHERE ordering_key = asked.key AND state = 'blocked'
            ORDER BY id LIMIT 1)
           - (SELECT count(*) FROM {jobs}
              WHERE ordering_key = asked.key
                AND state IN ('scheduled', 'available', 'running', 'retryable')) AS free
    FROM asked
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
    FROM picked
    WHERE j.id = picked.id AND j.state = 'blocked'
    RETURNING j.queue, j.priority, j.run_at
)"""
    + NOTIFY_MOVED
)

# Is anything waiting at all? The periodic full pass is skipped when not.
ANY_WAITING = """
SELECT EXISTS (SELECT 1 FROM {jobs} WHERE state = 'blocked')
"""
