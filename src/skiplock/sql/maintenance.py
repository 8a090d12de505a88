"""Rescuing jobs whose worker is gone, and keeping the worker registry current."""

from skiplock.sql.fence import HELD, HELD_IDS

# Notify each queue that received jobs, in the payload format of the insert trigger
# (migrations/0001_jobs.sql): queue, lowest priority, earliest run_at. Appended to a
# statement whose CTE `moved` returns queue, priority and run_at of the jobs it made
# available.
NOTIFY_MOVED = """
SELECT queue, count(*) AS jobs,
       pg_notify(%(channel)s, queue || E'\\t' || min(priority) || E'\\t'
                              || extract(epoch FROM min(run_at)))
FROM moved
GROUP BY queue
"""

# Liveness (decision 014): every session a worker opens for its own duties (the
# listener, the heartbeat's, the pools') holds a shared session-level advisory lock keyed
# on the worker's id, taken right after it connects. The worker lives while any of them
# does: one dropped connection (an idle-session timeout, a proxy, pg_terminate_backend)
# leaves the others holding. A dead process's backends all exit, and the last one to go
# frees the key.
WORKER_LOCK = """
SELECT pg_advisory_lock_shared(hashtextextended(%(id)s::text, 0))
"""

# The exclusive try-lock succeeds only when no session holds the shared lock: that worker
# is dead (or cut off from the database altogether), so its registration is removed and
# its running jobs go back at once instead of waiting out the lease. It reads the small
# workers table, not the jobs index, so it stays cheap while VACUUM is held back. The
# try-lock is transaction-scoped and released at commit; a live worker's locks simply make
# it return false. Never the rescuer's own worker: a backend does not conflict with its own
# lock, so on the rescuer's session the try-lock on its own key would succeed whenever its
# other sessions happen to be reconnecting.
# SKIP LOCKED: a registration that another transaction has locked (an application's
# SELECT ... FOR UPDATE, say) must not make the leader wait; that worker is found gone on
# a later pass, and the others' jobs are rescued meanwhile.
WORKERS_GONE = """
DELETE FROM {workers}
WHERE id = ANY(ARRAY(
    SELECT id FROM {workers}
    WHERE holds_lock AND id <> %(worker_id)s
      AND pg_try_advisory_xact_lock(hashtextextended(id::text, 0))
    FOR UPDATE SKIP LOCKED))
RETURNING id
"""

# Run only when WORKERS_GONE found someone, in the same transaction: with no worker gone
# the planner could still scan the running index, which while VACUUM is held back has an
# entry for every job that ever ran.
# A job claimed ahead by a prefetching worker that never recorded its start (sql/claim.py,
# JOB_CLAIM_AHEAD) is given its attempt back: it most likely never ran. Its start is
# recorded a moment after it starts, so a job that killed its worker at once looks the
# same; it is given back only once in a row (the last error says 'counted': false), so
# such a job still ends dead after max_attempts (decision 015).
_NEVER_STARTED = "(claimed_ahead AND coalesce(errors -> -1 ->> 'counted', '') <> 'false')"


# What an attempt's error record says of the attempt itself, from the row as the write
# that ends the attempt finds it: the worker that held it and when that worker claimed it
# (attempted_at; a job claimed ahead starts a moment later). The dashboard's timeline
# shows each attempt's claim, worker and end.
ATTEMPT_FACTS = "jsonb_build_object('worker', j.worker_id, 'claimed_at', j.attempted_at)"


def _rescued_columns(kind: str, why: str) -> str:
    """The SET list of a rescue: the attempt counted, or given back to a job that never
    started, and an error record that says which."""
    return f"""
    state = CASE WHEN {_NEVER_STARTED} OR attempts < max_attempts THEN 'available'
                 ELSE 'dead' END,
    attempts = attempts - CASE WHEN {_NEVER_STARTED} THEN 1 ELSE 0 END,
    errors = errors || jsonb_build_array(CASE
        WHEN {_NEVER_STARTED} THEN jsonb_build_object(
            'attempt', attempts,
            'at', now(),
            'type', '{kind}',
            'message', {why} || ' before the job started; the attempt is not counted',
            'traceback', NULL,
            'counted', false)
        ELSE jsonb_build_object(
            'attempt', attempts,
            'at', now(),
            'type', '{kind}',
            'message', {why} || '; job rescued',
            'traceback', NULL,
            'worker', worker_id,
            'claimed_at', attempted_at) END),
    claimed_ahead = false,
    worker_id = NULL,
    lease_expires_at = NULL"""


HISTORY_COLUMNS = """id, queue, task, args, state, priority, attempts, max_attempts, errors,
                    result, unique_key, ordering_key, created_at, attempted_at, progress,
                    started_at, worker_ids, meta"""


def cancelled_into_history(
    source: str, message: str, *, attempts: str = "attempts", progress: str = "progress"
) -> str:
    """The INSERT that ends jobs cancelled, as their requesters were told: the rows a CTE
    named ``source`` deleted (RETURNING *) go into history with ``message`` among their
    errors. ``attempts`` and ``progress`` are the expressions stored for those columns.
    The one place every statement that ends a job cancelled takes it from."""
    return f"""
INSERT INTO {{history}} ({HISTORY_COLUMNS})
SELECT id, queue, task, args, 'cancelled', priority, {attempts}, max_attempts,
       errors || jsonb_build_array(jsonb_build_object(
           'attempt', attempts, 'at', now(), 'type', 'Cancelled',
           'message', '{message}', 'traceback', NULL)),
       NULL, unique_key, ordering_key, created_at, attempted_at, {progress}, started_at,
       worker_ids, meta
FROM {source}
"""


# A job whose cancellation was asked for ends cancelled when its worker is gone.
_CANCELLED_INTO_HISTORY = cancelled_into_history("cancelled", "cancelled; its worker was gone")

# The jobs of the workers WORKERS_GONE found dead: back to their queues, except those
# whose cancellation was asked for, which end cancelled at once (waiting for the next
# JOB_CANCEL_ABANDONED pass left them running under a dead worker for half a lease).
# Rows come back as NOTIFY_MOVED's, plus one with no queue counting the cancelled jobs.
JOB_RESCUE_ORPHANED = (
    """
WITH cancelled AS (
    DELETE FROM {jobs}
    WHERE id = ANY(ARRAY(
        SELECT id FROM {jobs}
        WHERE state = 'running' AND worker_id = ANY(%(workers)s::uuid[])
          AND cancel_requested_at IS NOT NULL
        FOR UPDATE SKIP LOCKED))
    RETURNING *
), ended AS ("""
    + _CANCELLED_INTO_HISTORY
    + """    RETURNING id
), moved AS (
    UPDATE {jobs}
    SET"""
    + _rescued_columns("WorkerLost", "'worker ' || worker_id::text || ' lost its connection'")
    + """
    WHERE id = ANY(ARRAY(
        -- SKIP LOCKED here and below: a row locked by another transaction must never
        -- make the leader wait, or one stuck session would stop every rescue and the
        -- leader's own heartbeats. A skipped row is rescued on a later pass.
        SELECT id FROM {jobs}
        WHERE state = 'running' AND worker_id = ANY(%(workers)s::uuid[])
          AND cancel_requested_at IS NULL
        FOR UPDATE SKIP LOCKED))
    RETURNING queue, priority, run_at
)"""
    + NOTIFY_MOVED
    + """
UNION ALL
SELECT NULL, count(*), NULL::void FROM ended HAVING count(*) > 0
"""
)

# A running row that no live worker wrote (decision 022): its lease ends further ahead
# than its worker's leases ever do (workers.lease_seconds: a worker writes now() + that,
# and clock_timestamp() is past the writer's now()), or, under a worker not registered
# and holding no liveness lock, further ahead than any registered worker's, on a claim
# older than such a lease (a made-up id with an 'infinity' lease, say). Such a row would
# otherwise wait for a lease that may never end, holding a slot of a limited queue. An
# unregistered worker's ordinary lease is left to run out (JOB_RESCUE_EXPIRED): after a
# server restart the leader drops the registration of a worker still reconnecting, which
# goes on claiming and registers again at its next beat; its jobs are not strays (taken
# as such, they ran twice). Never the rescuer's own worker: its own try-lock would
# succeed (see WORKERS_GONE). CASE: the try-lock only for rows whose worker is not
# registered, and whose lease and claim say no worker wrote them.
_STRAY = """(
    CASE WHEN EXISTS (SELECT 1 FROM {workers} AS w WHERE w.id = j.worker_id)
         THEN j.lease_expires_at > clock_timestamp() + interval '1 second'
              + (SELECT w.lease_seconds FROM {workers} AS w WHERE w.id = j.worker_id)
                * interval '1 second'
         WHEN j.worker_id = %(worker_id)s THEN false
         WHEN j.lease_expires_at > clock_timestamp() + interval '1 second'
              + (SELECT max(w.lease_seconds) FROM {workers} AS w) * interval '1 second'
          AND coalesce(j.attempted_at, '-infinity') < clock_timestamp()
              - (SELECT max(w.lease_seconds) FROM {workers} AS w) * interval '1 second'
         THEN pg_try_advisory_xact_lock(hashtextextended(j.worker_id::text, 0))
         ELSE false END)"""

# A job whose cancellation was asked for while its worker died (or hung past its lease,
# or never existed) is not rescued: it ends cancelled, as asked.
JOB_CANCEL_ABANDONED = (
    """
WITH cancelled AS (
    DELETE FROM {jobs}
    WHERE id = ANY(ARRAY(
        SELECT id FROM {jobs} AS j
        WHERE state = 'running' AND cancel_requested_at IS NOT NULL
          AND (lease_expires_at < now() OR """
    + _STRAY
    + """)
        FOR UPDATE SKIP LOCKED))
    RETURNING *
)"""
    + _CANCELLED_INTO_HISTORY
    + """RETURNING queue, 1
"""
)

# A lease that ran out means a hung, partitioned or dead worker. Give the job back (or park
# it as dead when it has no attempts left) and say why on the job. Fenced on the deadline
# itself, so a lease extended a moment ago is left alone.
JOB_RESCUE_EXPIRED = (
    """
WITH moved AS (
UPDATE {jobs}
SET"""
    + _rescued_columns("LeaseExpired", "'lease expired on worker ' || worker_id::text")
    + """
WHERE id = ANY(ARRAY(
    SELECT id FROM {jobs}
    WHERE state = 'running' AND lease_expires_at < now() AND cancel_requested_at IS NULL
    FOR UPDATE SKIP LOCKED))
RETURNING queue, priority, run_at
)"""
    + NOTIFY_MOVED
)

# Running rows no live worker wrote (_STRAY), given back like a dead worker's jobs.
JOB_RESCUE_STRAY = (
    """
WITH moved AS (
UPDATE {jobs}
SET"""
    + _rescued_columns(
        "WorkerUnknown",
        """CASE WHEN EXISTS (SELECT 1 FROM {workers} AS w WHERE w.id = worker_id)
             THEN 'a lease longer than worker ' || worker_id::text || ' writes'
             ELSE 'running under worker ' || worker_id::text
                  || ', which is not registered' END""",
    )
    + """
WHERE id = ANY(ARRAY(
    SELECT id FROM {jobs} AS j
    WHERE state = 'running' AND cancel_requested_at IS NULL AND """
    + _STRAY
    + """
    FOR UPDATE SKIP LOCKED))
RETURNING queue, priority, run_at
)"""
    + NOTIFY_MOVED
)

# Scheduled and retryable jobs whose time has come join the claim index, at their run_at:
# a retried job resumes its place in line, usually behind claim cursors, which the
# notification's earliest run_at rewinds. SKIP LOCKED lets
# several promoters run at once without waiting on each other; each queue that received
# jobs is woken in the same statement.
JOB_PROMOTE_DUE = (
    """
WITH due AS (
    SELECT id
    FROM {jobs}
    WHERE state IN ('scheduled', 'retryable') AND coalesce(retry_at, run_at) <= now()
    ORDER BY coalesce(retry_at, run_at)
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE {jobs} AS j
    SET state = 'available'
    WHERE j.id = ANY(ARRAY(SELECT id FROM due))
    RETURNING j.queue, j.priority, j.run_at
)"""
    + NOTIFY_MOVED
)

# Seconds until the next waiting job comes due, or the next wait for a signal times out
# (on the database's clock), so the promoter can sleep exactly until then. NULL when
# nothing waits.
JOB_NEXT_DUE = """
SELECT extract(epoch FROM least(
    (SELECT min(coalesce(retry_at, run_at)) FROM {jobs}
     WHERE state IN ('scheduled', 'retryable')),
    (SELECT min(wait_until) FROM {jobs} WHERE wait_until IS NOT NULL)) - now())::float8
"""

# Become or stay leader: take the row when it is free or expired, renew it when it is
# ours, and take it from a leader whose liveness lock is free (none of its sessions is
# left, so it is dead: no need to wait out its ttl). Any other live holder makes the WHERE
# false and nothing comes back. Leaders without a liveness lock (behind a pooler) only
# expire.
LEADER_ELECT = """
INSERT INTO {leader} AS l (name, worker_id, expires_at)
VALUES ('maintenance', %(worker_id)s, now() + %(ttl)s * interval '1 second')
ON CONFLICT (name) DO UPDATE
SET worker_id = EXCLUDED.worker_id,
    elected_at = CASE WHEN l.worker_id = EXCLUDED.worker_id THEN l.elected_at ELSE now() END,
    expires_at = EXCLUDED.expires_at
WHERE l.worker_id = EXCLUDED.worker_id
   OR l.expires_at < now()
   OR (EXISTS (SELECT 1 FROM {workers} AS w WHERE w.id = l.worker_id AND w.holds_lock)
       AND pg_try_advisory_xact_lock(hashtextextended(l.worker_id::text, 0)))
RETURNING worker_id
"""

# Hand over cleanly on shutdown: the next worker to try is elected at once.
LEADER_RESIGN = """
DELETE FROM {leader} WHERE name = 'maintenance' AND worker_id = %(worker_id)s
"""

WORKER_REGISTER = """
INSERT INTO {workers} (id, host, pid, queues, concurrency, holds_lock)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(holds_lock)s)
ON CONFLICT (id) DO UPDATE SET last_seen_at = now()
"""

# The rescuer removes the registration of a worker it took for dead (its listener was
# reconnecting, say); touching re-registers it. Each touch also reports how often each of
# the worker's services was restarted (0013), and the length of the leases it writes
# (0019: the rescuer takes a lease further ahead than that for one no worker wrote,
# JOB_RESCUE_STRAY; until the first touch, a beat after registering, it is NULL and no
# lease of the worker is taken for such).
WORKER_TOUCH = """
INSERT INTO {workers} (id, host, pid, queues, concurrency, holds_lock, lease_seconds,
                       service_restarts)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(holds_lock)s,
        %(lease_seconds)s, %(service_restarts)s)
ON CONFLICT (id) DO UPDATE
SET last_seen_at = now(), service_restarts = EXCLUDED.service_restarts,
    lease_seconds = EXCLUDED.lease_seconds
"""

# The heartbeat: push the lease forward for every job this worker still holds. A job
# missing from the result was rescued (or finished): its handler should stop. A job
# returned with a cancel request is cancelled, in case its notification was missed.
#
# SKIP LOCKED: a row another transaction has locked (an application's SELECT ... FOR
# UPDATE on a running job, a rescue in progress) is not waited for, or one such lock would
# hold up the leases of every job of this worker. Such a job still comes back, read from
# the snapshot, with `extended` false: it is still ours, its lease is extended at a later
# beat (and if a rescue was what held it, the next beat finds it gone).
JOB_EXTEND_LEASES_SKIP_LOCKED = (
    """
WITH held AS (
    SELECT j.id, j.cancel_requested_at IS NOT NULL AS cancel
    FROM {jobs} AS j
    WHERE """
    + HELD_IDS
    + """
), extended AS (
    UPDATE {jobs} AS j
    SET lease_expires_at = now() + %(lease_seconds)s * interval '1 second'
    WHERE j.id = ANY(ARRAY(
        SELECT k.id FROM {jobs} AS k
        WHERE k.id = ANY(ARRAY(SELECT id FROM held))
        FOR UPDATE SKIP LOCKED))
      AND """
    + HELD
    + """
    RETURNING j.id
)
SELECT held.id, held.cancel, EXISTS (SELECT 1 FROM extended WHERE extended.id = held.id)
FROM held
"""
)

WORKER_DEREGISTER = """
DELETE FROM {workers} WHERE id = %(id)s
"""


# -- Reconciliation (worker/heartbeat.py) ------------------------------------------------
# A live worker can hold, in the database, jobs it does not run: the answer of a claim
# lost with its connection after the claim committed, or an outcome written and then lost
# (an asynchronous failover). Neither liveness (the worker is alive) nor the lease (only
# once it ends) gives them back soon; the worker's heartbeat compares and gives them back.

# The database's clock, read by the heartbeat as it begins to compare, in the transaction
# that compares: a claim sent after the answer came back starts later on the server, so
# every job it claims has an attempted_at at or after this (now() is the transaction's
# start, earlier still). Rows claimed before it come from claims whose answers the worker
# has read, or lost. In the same round trip, the comparison's statements get a bound of
# their own, shorter than the heartbeat's: a slow one must not hold up the next beat.
DATABASE_CLOCK_READ = """
SELECT now(), set_config('statement_timeout', %(statement_timeout)s, true)
"""

# The jobs running under this worker in the database that it does not know: neither
# running nor waiting for a slot there (held), nor with an outcome still to write, and
# claimed before %(before)s (the oldest claim of the worker still in flight cannot have
# claimed them). A plain read: no lock, never waits. It walks this worker's entries of the
# jobs_running index, which while VACUUM is held back include every job the worker ran
# since: about the cost of the leader's pass over expired leases, once a beat per worker.
# A row written by hand with no attempted_at was claimed by no claim of the worker's.
JOB_RUNNING_UNKNOWN = """
SELECT id, attempts, cancel_requested_at IS NOT NULL
FROM {jobs}
WHERE state = 'running' AND worker_id = %(worker_id)s
  AND id <> ALL(%(known)s::bigint[])
  AND coalesce(attempted_at, '-infinity') < %(before)s
ORDER BY id
"""

# Give those jobs back, as rescue gives back a dead worker's (_rescued_columns): a job
# still marked claimed ahead never started and gets its attempt back (once in a row,
# decision 015); any other may have run (its outcome lost), so the attempt counts, and a
# job out of attempts is dead. Fenced on worker and attempt, as read above: a job given
# back meanwhile and claimed again (by this worker too) has another attempt. SKIP LOCKED:
# a row another transaction holds is left for the next beat. A job whose cancellation
# was asked for is not given back here: it ends cancelled (complete.py's
# JOB_CANCEL_MANY_IF_LEASED, written for it as its worker would have).
JOB_GIVE_BACK_UNKNOWN = (
    """
WITH moved AS (
    UPDATE {jobs} AS j
    SET"""
    + _rescued_columns(
        "Reconciled",
        "'worker ' || worker_id::text || ' was not running it (a claim''s answer or an "
        "outcome was lost)'",
    )
    + """
    WHERE j.id = ANY(ARRAY(
        SELECT k.id FROM {jobs} AS k
        WHERE k.id = ANY(%(ids)s::bigint[])
        FOR UPDATE SKIP LOCKED))
      AND """
    + HELD
    + """
      AND j.cancel_requested_at IS NULL
    RETURNING queue, priority, run_at
)"""
    + NOTIFY_MOVED
)
