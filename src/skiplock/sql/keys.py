"""Admitting keyed jobs: the only writers that turn 'blocked' into runnable (0008, 0015).

The admission itself is a function of the schema (migration 0015, ``keys_admit``), so
that the statement deleting an admitted keyed job can admit its key's next one through a
trigger, and the leader runs the very same code for the keys it is asked about. Each call
first takes the keys' locks and only then admits, in a statement whose snapshot is taken
once the locks are held: it sees everything the previous admitter of each key committed,
so two admitters (two completions, a completion and the leader, a leader and one that
has not yet noticed it lost) never admit past a key's limit between them.
"""

# The keys asked about, each admitted as far as it has room (keys_admit, 0015): rows of
# (queue, jobs admitted), then (NULL, 0, key) for each key another admitter held (a
# completion admitting it right now): those are left alone, never waited for. One
# transaction: it holds one lock per key until it commits, so callers pass a bounded
# number of keys (skiplock.admission.ADMIT_KEYS_CHUNK).
ADMIT = """
SELECT queue, jobs, busy FROM {schema}.keys_admit(%(keys)s::text[], NULL, false)
"""

# The oldest waiting job of each key asked about, if it fits (the fallback of
# skiplock.admission, which finds a row that cannot be admitted by trying the head of its
# key's line alone).
ADMIT_HEADS = """
SELECT queue, jobs, busy FROM {schema}.keys_admit(%(keys)s::text[], 1, true)
"""

# The keys' locks, until the transaction ends, waited for (within lock_timeout), and no
# admission (room for none): the fallback reads a key's head and makes it dead under the
# lock that ADMIT_HEADS takes again (the locks are re-entrant).
KEYS_LOCK = """
SELECT count(*) FROM {schema}.keys_admit(%(keys)s::text[], 0, true)
"""

# Rate-limited keys that still have waiting jobs, and in how many seconds the oldest
# admission in each one's window leaves it (room for one more). The leader comes back
# for them then. Key by key (LATERAL ... LIMIT 1): a semi-join may be planned as a hash
# of every waiting job, read on every pass even when no key has a rate.
KEY_RATE_NEXT = """
SELECT r.key, r.period - max(extract(epoch FROM statement_timestamp() - t))::float8
FROM {key_rates} AS r,
     LATERAL (SELECT 1 FROM {jobs}
              WHERE ordering_key = r.key AND state = 'blocked' LIMIT 1) AS waiting,
     unnest(r.admissions) AS t
WHERE extract(epoch FROM statement_timestamp() - t) < r.period
GROUP BY r.key, r.period
"""

# Logs of keys whose window has emptied and that have nothing waiting.
KEY_RATES_PRUNE = """
DELETE FROM {key_rates} AS r
WHERE NOT EXISTS (SELECT 1 FROM unnest(r.admissions) AS t
                  WHERE extract(epoch FROM now() - t) < r.period)
  AND NOT EXISTS (SELECT 1 FROM {jobs} WHERE ordering_key = r.key AND state = 'blocked')
"""

# Every key with waiting jobs: the keys of the leader's full pass.
KEYS_WAITING = """
SELECT DISTINCT ordering_key FROM {jobs} WHERE state = 'blocked' ORDER BY ordering_key
"""

# Keys with waiting jobs and none admitted: the only ones that can wait forever when a
# request for them was lost (any other key is admitted again as soon as one of its
# admitted jobs ends, decision 017). The leader's periodic pass, which no request asked
# for, visits these: a look-up per waiting key instead of an admission.
KEYS_STALLED = """
SELECT w.key
FROM (SELECT DISTINCT ordering_key AS key FROM {jobs} WHERE state = 'blocked') AS w
WHERE NOT EXISTS (SELECT 1 FROM {jobs} AS a
                  WHERE a.ordering_key = w.key
                    AND a.state IN ('scheduled', 'available', 'running', 'retryable'))
ORDER BY w.key
"""

# The oldest waiting job of a key: the one ADMIT_HEADS tries.
KEY_WAITING_HEAD = """
SELECT id FROM {jobs} WHERE ordering_key = %(key)s AND state = 'blocked' ORDER BY id LIMIT 1
"""

# A waiting job that could not be admitted even alone ends dead, with the reason among
# its errors, so that it does not stop admission for every key. Fenced on 'blocked': a job
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
