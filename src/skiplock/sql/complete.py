"""Writing outcomes. Every write is fenced: it only touches a row this worker still holds.

The fence is id + attempts (the attempt's token) + worker_id. There is deliberately no
``state = 'running'`` test: the jobs_lease_iff_running constraint makes it implied by
worker_id, and spelling it out would let the planner pick the partial jobs_running index,
which while VACUUM is held back holds an entry for every job that ever ran.

Lease-mode statements take parallel arrays (one statement per outcome kind per batch) and
return the ids they changed; the caller compares them with what it sent and counts the
refused ones. A refusal means the lease was lost and the job was rescued, maybe already
re-run elsewhere: the stale attempt must not overwrite it.
"""

from skiplock.sql.fence import HELD_IDS
from skiplock.sql.maintenance import (
    ATTEMPT_FACTS,
    HISTORY_COLUMNS,
    NOTIFY_MOVED,
    cancelled_into_history,
)

# ROBUST_LOOKUP: no statement here joins jobs to the batch. A join's plan depends on the
# statistics, and a queue table is analyzed while it holds a few live rows among many dead
# ones: the planner then takes it for tiny and joins by walking the whole primary key
# (every dead entry while VACUUM is held back; measured on PostgreSQL 18: 1,400 index
# entries read per job), or, told the ids, loops over the batch once per row. Instead the
# rows are found by `j.id = ANY(ids)`, an index condition in any plan, and each row's own
# values (its attempt, result, ...) are looked up by id in %(batch)s, a jsonb object keyed
# by id: a binary search per row (decision 013).


# The end of an attempt whose job stays in the table (failed, snoozed): its latest
# progress kept, its lease dropped, fenced.
_ATTEMPT_LEFT = (
    """    progress = coalesce((%(batch)s::jsonb -> j.id::text ->> 'progress')::jsonb, j.progress),
    worker_id = NULL,
    lease_expires_at = NULL
WHERE """
    + HELD_IDS
    + """
RETURNING j.id
"""
)

JOB_COMPLETE_MANY_IF_LEASED = (
    """
WITH done AS (
    DELETE FROM {jobs} AS j
    WHERE """
    + HELD_IDS
    + """
    RETURNING j.*, %(batch)s::jsonb -> j.id::text ->> 'result' AS result,
              %(batch)s::jsonb -> j.id::text ->> 'progress' AS last_progress
)
INSERT INTO {history} ("""
    + HISTORY_COLUMNS
    + """)
SELECT id, queue, task, args, 'completed', priority, attempts, max_attempts, errors,
       result::jsonb, unique_key, ordering_key, created_at, attempted_at,
       coalesce(last_progress::jsonb, progress), started_at, worker_ids, meta
FROM done
RETURNING id
"""
)

# A failed attempt: retryable until retry_at (now + delay), or dead. run_at is left alone:
# it is the job's place in line. Even with no delay the job goes through the promoter,
# whose notification rewinds claim cursors to its (older) place. The lease is
# dropped either way; the error is appended so every attempt's failure is kept, with the
# worker that ran the attempt and when it claimed it (ATTEMPT_FACTS), read from the row the
# fence has just matched.
JOB_FAIL_MANY_IF_LEASED = (
    """
UPDATE {jobs} AS j
SET state = CASE WHEN (%(batch)s::jsonb -> j.id::text -> 'dead')::boolean THEN 'dead'
                 ELSE 'retryable' END,
    retry_at = now()
               + (%(batch)s::jsonb -> j.id::text ->> 'delay')::float8 * interval '1 second',
    errors = j.errors || jsonb_build_array((%(batch)s::jsonb -> j.id::text -> 'error')
                                           || """
    + ATTEMPT_FACTS
    + """),
"""
    + _ATTEMPT_LEFT
)

# A running job whose cancellation was requested ends here: into history as cancelled,
# with the reason among its errors.
JOB_CANCEL_MANY_IF_LEASED = (
    """
WITH done AS (
    DELETE FROM {jobs} AS j
    WHERE """
    + HELD_IDS
    + """
    RETURNING j.*, %(batch)s::jsonb -> j.id::text ->> 'progress' AS last_progress
)"""
    + cancelled_into_history(
        "done", "cancelled while running", progress="coalesce(last_progress::jsonb, progress)"
    )
    + "RETURNING id\n"
)

# "Not yet": the handler raised Snooze. Back of the queue after the delay, and the attempt
# is given back: nothing failed.
JOB_SNOOZE_MANY_IF_LEASED = (
    """
UPDATE {jobs} AS j
SET state = CASE WHEN (%(batch)s::jsonb -> j.id::text ->> 'delay')::float8 > 0 THEN 'scheduled'
                 ELSE 'available' END,
    run_at = now() + (%(batch)s::jsonb -> j.id::text ->> 'delay')::float8 * interval '1 second',
    retry_at = NULL,
    attempts = j.attempts - 1,
"""
    + _ATTEMPT_LEFT
)

# A flush whose outcomes are all of one kind (the usual case) is one of the four
# statements above made to commit alone, in the worker's autocommit session, instead of a
# pipelined transaction of five (BEGIN, SET LOCAL synchronous_commit, the write, the
# waiters' pg_notify, COMMIT): each statement costs the worker an event-loop wait and the
# server a protocol round, which for a batch of short jobs cost more than the write (issue
# 21's profile). The two others happen inside it: set_config(..., true) turns
# synchronous_commit back on until its own transaction ends, so that the commit waits for
# the WAL flush as DURABLE_COMMIT_ON makes it, and pg_notify wakes result waiters at the
# commit as JOBS_DONE_NOTIFY does. Both are in a CTE of volatile calls, which is never
# folded away, and the last branch of the UNION reads it whether or not a row was
# written: they run once per flush, as before. That branch returns no row.
_DURABLE_ALONE = """durable AS (
    SELECT set_config('synchronous_commit', 'on', true) AS setting,
           pg_notify(%(channel)s, '') AS woken
)"""
_WRITTEN_ALONE = """
SELECT id FROM written
UNION ALL
SELECT NULL FROM durable WHERE setting IS NULL
"""


def _committing_alone(statement: str) -> str:
    """``statement`` (a fenced outcome write returning the ids it wrote) as one that
    commits alone: durably, waking result waiters, and returning the same ids."""
    body = statement.strip()
    if not body.endswith(("RETURNING id", "RETURNING j.id")):
        raise RuntimeError("an outcome write changed shape; update _committing_alone")
    if body.startswith("WITH done AS ("):
        ctes, found, write = body.rpartition("\n)\nINSERT INTO ")
        if not found:
            raise RuntimeError("an outcome write changed shape; update _committing_alone")
        text = f"WITH {_DURABLE_ALONE}, {ctes[5:]}\n), written AS (\nINSERT INTO {write}\n)"
    elif body.startswith("UPDATE "):
        text = f"WITH {_DURABLE_ALONE}, written AS (\n{body}\n)"
    else:
        raise RuntimeError("an outcome write changed shape; update _committing_alone")
    return "\n" + text + _WRITTEN_ALONE


JOB_COMPLETE_MANY_ALONE = _committing_alone(JOB_COMPLETE_MANY_IF_LEASED)
JOB_FAIL_MANY_ALONE = _committing_alone(JOB_FAIL_MANY_IF_LEASED)
JOB_CANCEL_MANY_ALONE = _committing_alone(JOB_CANCEL_MANY_IF_LEASED)
JOB_SNOOZE_MANY_ALONE = _committing_alone(JOB_SNOOZE_MANY_IF_LEASED)

JOB_SNOOZE_LOCKED = """
UPDATE {jobs}
SET state = CASE WHEN %(delay)s > 0 THEN 'scheduled' ELSE 'available' END,
    run_at = now() + %(delay)s * interval '1 second',
    retry_at = NULL
WHERE id = %(id)s AND state = 'available'
RETURNING id
"""

# A running job's progress, fenced like any write about it.
JOB_PROGRESS_SET = """
UPDATE {jobs}
SET progress = %(progress)s::jsonb
WHERE id = %(id)s AND attempts = %(attempt)s AND worker_id = %(worker_id)s
RETURNING id
"""

JOBS_DONE_NOTIFY = """
SELECT pg_notify(%(channel)s, '')
"""


def _handed_back(narrowed: str, cancelled: str, *, history_attempts: str, errors: str) -> str:
    """Jobs this worker holds (of %(ids)s, fenced, and ``narrowed``: more AND terms) go
    back to their queues, their attempt given back and ``errors`` their new errors; those
    whose cancellation was asked for end cancelled instead, ``cancelled`` their reason.
    Rows come back as NOTIFY_MOVED's, plus one with no queue counting the cancelled."""
    return (
        """
WITH cancelled AS (
    DELETE FROM {jobs} AS j
    WHERE """
        + HELD_IDS
        + narrowed
        + """
      AND j.cancel_requested_at IS NOT NULL
    RETURNING j.*
), ended AS ("""
        + cancelled_into_history("cancelled", cancelled, attempts=history_attempts)
        + """    RETURNING id
), moved AS (
    UPDATE {jobs} AS j
    SET state = 'available',
        attempts = j.attempts - 1,
        errors = """
        + errors
        + """,
        claimed_ahead = false,
        worker_id = NULL,
        lease_expires_at = NULL
    WHERE """
        + HELD_IDS
        + narrowed
        + """
      AND j.cancel_requested_at IS NULL
    RETURNING j.queue, j.priority, j.run_at
)"""
        + NOTIFY_MOVED
        + """
UNION ALL
SELECT NULL, count(*), NULL::void FROM ended HAVING count(*) > 0
"""
    )


# Graceful shutdown ran out of time: the attempt was cut short, not failed, so it is
# given back, and the job is available at once. A job whose cancellation was asked for
# ends cancelled instead, as the requester was told (and as JOB_CANCEL_ABANDONED ends one
# whose worker died): released, it would run again, and the request, left on the row,
# would cancel that next attempt at its first heartbeat, or never if it finished first.
# Rows come back as NOTIFY_MOVED's, plus one with no queue counting the cancelled jobs
# (the worker then wakes callers awaiting their results).
JOB_RELEASE_MANY_IF_LEASED = _handed_back(
    "",
    "cancelled; its worker stopped before the job finished",
    history_attempts="attempts",
    errors="""j.errors || jsonb_build_array(jsonb_build_object(
            'attempt', j.attempts,
            'at', now(),
            'type', 'WorkerShutdown',
            'message', 'worker stopped before the job finished; the attempt is not counted',
            'traceback', NULL) || """
    + ATTEMPT_FACTS
    + ")",
)

# A job claimed ahead that never started goes back, from the worker that holds it: it
# waited at the worker's gate past the bound while the worker's slots were busy (another
# worker may have a free one), or the worker is stopping (decision 018). Fenced like an
# outcome and on the mark too: a job whose start was recorded is never given back as
# unstarted. Nothing happened to it: its attempt is given back and its queued-scope
# unique key, kept since the claim, stays. A stopping worker notes why (%(note)s, as a
# WorkerShutdown record, like a released job's); a give-back on time notes nothing, or
# the errors of a job of a busy queue would grow with each one. As for a released job, one
# whose cancellation was asked for ends cancelled instead. The UPDATE fires no trigger
# that wakes workers: NOTIFY_MOVED does, in this statement, so an idle worker claims the
# jobs at once rather than at its next poll. Rows come back as JOB_RELEASE_MANY_IF_LEASED's.
JOB_GIVE_BACK_UNSTARTED = _handed_back(
    "\n      AND j.claimed_ahead",
    "cancelled before it started",
    history_attempts="attempts - 1",
    errors="""CASE WHEN %(note)s::text IS NULL THEN j.errors
                      ELSE j.errors || jsonb_build_array(jsonb_build_object(
                          'attempt', j.attempts,
                          'at', now(),
                          'type', 'WorkerShutdown',
                          'message', %(note)s::text,
                          'traceback', NULL,
                          'worker', j.worker_id)) END""",
)

# A transactional handler's time limit: the server ends a session left idle inside its
# transaction (a sync handler stuck outside SQL) or a statement running longer, and the
# rollback makes the job claimable again. Transaction-local, so it would last to the end
# of the batch: SESSION_LIMITS_READ is taken first and the same statement puts the
# values read back once the job is done, before the next job of the batch starts.
SESSION_LIMIT = """
SELECT set_config('idle_in_transaction_session_timeout', %(idle)s, true),
       set_config('statement_timeout', %(statement)s, true)
"""

SESSION_LIMITS_READ = """
SELECT current_setting('idle_in_transaction_session_timeout'),
       current_setting('statement_timeout')
"""

# A transactional job's session ended while it ran (the server ended a handler stuck past
# its timeout, a DBA, a network cut): its transaction rolled back, attempt and all. The
# attempt is counted here, from another session once the row is free (decision 002,
# "Counting an attempt the session took with it"). SKIP LOCKED: a row still locked is
# still being run, by this session (alive after all) or by the next one; and attempts is
# the fence, so the attempt is counted once however many times this runs.
JOB_CHARGE_LOST_ATTEMPT = """
UPDATE {jobs} AS j
SET state = CASE WHEN j.attempts + 1 >= j.max_attempts THEN 'dead'
                 WHEN %(delay)s > 0 THEN 'retryable' ELSE 'available' END,
    attempts = j.attempts + 1,
    attempted_at = now(),
    retry_at = now() + %(delay)s * interval '1 second',
    errors = j.errors || jsonb_build_array(%(error)s::jsonb),
    unique_queued_key = NULL  -- it has started: a queued-scope key is released (0007)
WHERE j.id = (
    SELECT id FROM {jobs}
    WHERE id = %(id)s AND attempts = %(attempts)s AND state = 'available'
    FOR UPDATE SKIP LOCKED
)
RETURNING j.state
"""

# A sync transactional job with a timeout is watched from a second session queued on its
# row lock: should the server end the job's session (the handler stuck past its
# timeout), this wait is granted before any SKIP LOCKED claim can take the row, and
# JOB_CHARGE_LOST_ATTEMPT runs in the same transaction. The fence is the attempt count:
# a job that committed meanwhile (completed, failed) no longer matches.
JOB_AWAIT_SESSION_END = """
SELECT id FROM {jobs}
WHERE id = %(id)s AND attempts = %(attempts)s AND state = 'available'
FOR UPDATE
"""

# Asked on the job's own session before its handler starts: is the watch's session
# queued on this transaction's row lock yet? Only then may the handler hang safely.
WATCH_IS_WAITING = """
SELECT pg_backend_pid() = ANY(pg_blocking_pids(%(watcher)s))
"""

# Lease mode, one row: an outcome whose write was refused for that row alone (a value
# PostgreSQL would not take) becomes a failed attempt with the reason. Dead once its
# attempts are used up, decided here where max_attempts is known. Fenced as the others.
JOB_FAIL_UNSTORABLE_IF_LEASED = (
    """
UPDATE {jobs} AS j
SET state = CASE WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'retryable' END,
    retry_at = now() + %(delay)s * interval '1 second',
    errors = j.errors || jsonb_build_array(%(error)s::jsonb || """
    + ATTEMPT_FACTS
    + """),
    worker_id = NULL,
    lease_expires_at = NULL
WHERE j.id = %(id)s AND j.attempts = %(attempt)s AND j.worker_id = %(worker_id)s
RETURNING j.id
"""
)

# Worker connections commit claims, heartbeats and maintenance without waiting for the WAL
# flush (see DURABLE_COMMIT_OFF's comment); outcomes are written with it back on.
DURABLE_COMMIT_ON = """
SET LOCAL synchronous_commit TO on
"""

# Transactional mode: the row lock taken by JOB_LOCK_BATCH is held by this very
# transaction, so the lock is the fence; the state check guards against misuse.
JOB_COMPLETE_LOCKED = (
    """
WITH done AS (
    DELETE FROM {jobs}
    WHERE id = %(id)s AND state = 'available'
    RETURNING *
)
INSERT INTO {history} ("""
    + HISTORY_COLUMNS
    + """)
SELECT id, queue, task, args, 'completed', priority, attempts + 1, max_attempts, errors,
       %(result)s::jsonb, unique_key, ordering_key, created_at, now(), progress,
       started_at, worker_ids, meta
FROM done
RETURNING id
"""
)

JOB_FAIL_LOCKED = """
UPDATE {jobs}
SET state = CASE WHEN %(dead)s THEN 'dead' WHEN %(delay)s > 0 THEN 'retryable'
                 ELSE 'available' END,
    attempts = attempts + 1,
    attempted_at = now(),
    retry_at = now() + %(delay)s * interval '1 second',
    errors = errors || jsonb_build_array(%(error)s::jsonb),
    unique_queued_key = NULL  -- it has started: a queued-scope key is released (0007)
WHERE id = %(id)s AND state = 'available'
RETURNING id
"""

# Transactional mode, the shutdown deadline: the job still running is cut short. Its
# savepoint (named JOB_SAVEPOINT) rolled back, its attempt is not counted (it was cut
# short, not failed) and, as lease mode's release does, a note says why. The row lock
# held by the batch's transaction is the fence.
JOB_SAVEPOINT = "skiplock_job"

JOB_NOTE_SHUTDOWN_LOCKED = """
UPDATE {jobs}
SET errors = errors || jsonb_build_array(jsonb_build_object(
        'attempt', attempts + 1,
        'at', now(),
        'type', 'WorkerShutdown',
        'message', 'worker stopped before the job finished; the attempt is not counted',
        'traceback', NULL))
WHERE id = %(id)s AND state = 'available'
"""

# The same cut for a sync session, made from another thread while the session's own is
# still in the handler (a thread cannot be stopped): the job's savepoint rolled back, its
# note, the wake-up of result waiters, the commit of the jobs finished before it. One
# query string, sent as one message (bound client-side, simple protocol): nothing the
# handler still sends can come between the rollback and the commit. The BEGIN at the end
# holds whatever it sends next in a transaction that never commits: the session is
# closed right after.
BATCH_COMMIT_CUT = (
    "ROLLBACK TO SAVEPOINT "
    + JOB_SAVEPOINT
    + ";\n"
    + JOB_NOTE_SHUTDOWN_LOCKED.strip()
    + ";\n"
    + JOBS_DONE_NOTIFY.strip()
    + ";\nCOMMIT;\nBEGIN"
)
