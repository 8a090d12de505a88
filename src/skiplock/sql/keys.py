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

# For each key asked about (ADMIT_ALL: every key with waiting jobs), the key's oldest
# waiting jobs are admitted, oldest first, as many as fit. Every job's own key_limit holds
# while it is admitted: a key never has more admitted jobs than the lowest limit among
# them (jobs of one key may carry different limits: a deploy changed concurrency_limit
# while they waited, or an ordering key and a concurrency key share a name). So the room
# is the lowest limit among the admitted jobs and the oldest waiting one, minus the
# admitted; of the waiting jobs that fit in it, the line is cut before the first job
# whose own limit (or an older waiting job's) would be exceeded: admitted + place <=
# lowest limit so far, which once false stays false, so what is admitted is always the
# head of the line. With a rate (the oldest waiting job's), the room is also the rate
# minus the admissions logged within the period; the admission times of rate-limited
# keys are logged. Periods are compared in seconds (float8), never turned into
# intervals, so no stored value can overflow the statement for every key.
# ADMIT_HEADS admits at most one job per key (the fallback of skiplock.admission, which
# finds a row that cannot be admitted by trying the head of its key's line alone).
# statement_timestamp(): this statement starts after the lock is held. A job retried by
# hand may carry a retry_at from before; it runs at once when admitted.
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


def _admit(most: str) -> str:
    return (
        """
), head AS (
    SELECT asked.key, oldest.key_limit, oldest.key_rate, oldest.key_period
    FROM asked,
         LATERAL (SELECT key_limit, key_rate, key_period FROM {jobs}
                  WHERE ordering_key = asked.key AND state = 'blocked'
                  ORDER BY id LIMIT 1) AS oldest
), room AS (
    SELECT head.key, head.key_rate, head.key_period, admitted.jobs AS admitted,
           least(
               least(head.key_limit, admitted.lowest_limit) - admitted.jobs,
               head.key_rate
               - (SELECT count(*) FROM {key_rates} AS r, unnest(r.admissions) AS t
                  WHERE r.key = head.key
                    AND extract(epoch FROM statement_timestamp() - t) < head.key_period),
               """
        + most
        + """
           ) AS free
    FROM head,
         LATERAL (SELECT count(*) AS jobs, min(key_limit) AS lowest_limit FROM {jobs}
                  WHERE ordering_key = head.key
                    AND state IN ('scheduled', 'available', 'running', 'retryable'))
         AS admitted
), picked AS (
    SELECT fits.id
    FROM room,
         LATERAL (SELECT line.id
                  FROM (SELECT id,
                               row_number() OVER (ORDER BY id) AS place,
                               min(key_limit) OVER (ORDER BY id) AS lowest_limit
                        FROM (SELECT id, key_limit FROM {jobs}
                              WHERE ordering_key = room.key AND state = 'blocked'
                              ORDER BY id
                              LIMIT room.free) AS oldest) AS line
                  WHERE room.admitted + line.place <= line.lowest_limit) AS fits
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
            WHERE extract(epoch FROM statement_timestamp() - t) < EXCLUDED.period
            ORDER BY t) || EXCLUDED.admissions
)"""
        + NOTIFY_MOVED
    )


ADMIT = _ASKED_KEYS + _admit("NULL")
# The periodic full pass: the same for every key with waiting jobs.
ADMIT_ALL = _ASKED_ALL + _admit("NULL")
# The oldest waiting job of each key asked about, if it fits.
ADMIT_HEADS = _ASKED_KEYS + _admit("1")

# Rate-limited keys that still have waiting jobs, and in how many seconds the oldest
# admission in each one's window leaves it (room for one more). The leader comes back
# for them then.
KEY_RATE_NEXT = """
SELECT r.key, r.period - max(extract(epoch FROM statement_timestamp() - t))::float8
FROM {key_rates} AS r, unnest(r.admissions) AS t
WHERE extract(epoch FROM statement_timestamp() - t) < r.period
  AND EXISTS (SELECT 1 FROM {jobs} WHERE ordering_key = r.key AND state = 'blocked')
GROUP BY r.key, r.period
"""

# Logs of keys whose window has emptied and that have nothing waiting.
KEY_RATES_PRUNE = """
DELETE FROM {key_rates} AS r
WHERE NOT EXISTS (SELECT 1 FROM unnest(r.admissions) AS t
                  WHERE extract(epoch FROM now() - t) < r.period)
  AND NOT EXISTS (SELECT 1 FROM {jobs} WHERE ordering_key = r.key AND state = 'blocked')
"""

# Every key with waiting jobs: the keys the fallback of skiplock.admission bisects when
# the full pass failed.
KEYS_WAITING = """
SELECT DISTINCT ordering_key FROM {jobs} WHERE state = 'blocked' ORDER BY ordering_key
"""

# The oldest waiting job of a key: the one ADMIT_HEADS tries.
KEY_WAITING_HEAD = """
SELECT id FROM {jobs} WHERE ordering_key = %(key)s AND state = 'blocked' ORDER BY id LIMIT 1
"""

# A waiting job that could not be admitted even alone ends dead, with the reason among
# its errors (it used to stop admission for every key). Fenced on 'blocked': a job
# cancelled or admitted meanwhile is left alone. Its key's trigger asks for the key again.
JOB_DEAD_IF_WAITING = """
UPDATE {jobs}
SET state = 'dead',
    errors = errors || jsonb_build_array(jsonb_build_object(
        'attempt', attempts, 'at', now(), 'type', 'AdmissionFailed',
        'message', %(reason)s::text, 'traceback', NULL))
WHERE id = %(id)s AND state = 'blocked'
RETURNING id
"""

# Is anything waiting at all? The periodic full pass is skipped when not.
ANY_WAITING = """
SELECT EXISTS (SELECT 1 FROM {jobs} WHERE state = 'blocked')
"""
