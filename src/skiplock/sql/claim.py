"""Taking ready jobs off a queue without fighting other workers over them."""

from skiplock.sql.fence import HELD

# Worker connections run with synchronous_commit off. A claim, heartbeat or rescue lost in
# a server crash only makes a job claimable again, which at-least-once delivery allows (and
# fencing refuses the old attempt's completion); the enqueue itself was durable in the
# caller's transaction. Skipping the WAL flush takes a disk wait off every claim, which is
# most of the idle enqueue-to-start latency. Outcomes switch it back on (DURABLE_COMMIT_ON).
#
# And without sequential scans unless nothing else will do: every worker statement is
# written for an index, but a queue table is often analyzed while it holds a few live rows
# among many dead ones, and a planner that takes it for tiny may choose to read all of it.
# With VACUUM held back that is every version of every job since. (Joins by id also say
# `id = ANY(...)` for the same reason: sql/complete.py.)
#
# And without JIT compilation: a refused sequential scan is priced at 10^10, so a statement
# that still needs one (a read of the small workers table) passes jit_above_cost, and
# compiling it costs far more than running it: about 300 ms of server CPU per run for the
# stray rescue, tens of ms per second for the rescuer's WORKERS_GONE. No worker statement
# runs long enough to gain from compiling.
WORKER_SESSION_OPTIONS = "-c synchronous_commit=off -c enable_seqscan=off -c jit=off"

# Lease mode: lock up to `limit` ready rows, skipping those another worker holds, and mark
# them running in the same statement; the caller commits at once. The CTE is what makes
# LIMIT bind: a bare UPDATE ... WHERE id IN (SELECT ... LIMIT) may be planned to update
# more rows than the limit. The inner ORDER BY matches the jobs_claim index exactly. The
# update finds the picked rows by `id = ANY(ARRAY(...))`, an index condition on the
# primary key whatever the statistics say (see ROBUST_LOOKUP in sql/complete.py).
# run_at <= now() guards rows inserted by hand as 'available' with a future run_at. The
# queue check is a single primary-key lookup, evaluated once per claim: a paused queue
# gives nothing, nor does a queue with limits to a claim that does not apply them
# (governed false). The worker learns of new limits from a 'limits' message or its next
# read (worker/limits.py); until then this check, in the claim's own snapshot, is what
# keeps a limit committed before the claim from being exceeded.
# attempts + 1 becomes this attempt's fencing token. claimed_ahead is false here, where
# every job claimed has its run permit in hand, and true in claims that bring more jobs
# than the worker has permits free (JOB_CLAIM_AHEAD): those may wait for a slot, and
# rescue gives back the attempt of one that never started (decision 015).
# Arguments come back as text and timestamps clamped to what Python's datetime can hold,
# so that a row written by hand that Python cannot decode fails as one job
# (executor.claimed_from_row) instead of failing the whole claim. The meta (0017) comes
# back as text too, decoded only by a tracer (skiplock/tracing.py); it is NULL unless one
# stored something.
JOB_CLAIM_BATCH = """
WITH picked AS (
    SELECT id
    FROM {jobs}
    WHERE queue = %(queue)s
      AND state = 'available'
      AND run_at <= now()
      AND task <> ALL(%(exclude_tasks)s::text[])
      AND NOT EXISTS (SELECT 1 FROM {queues} WHERE name = %(queue)s
                      AND (paused OR NOT %(governed)s
                           AND (concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL)))
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {jobs} AS j
SET state = 'running',
    -- A queued-scope unique key is released for good once the job starts (0007).
    unique_queued_key = NULL,
    attempts = j.attempts + 1,
    claimed_ahead = false,
    worker_id = %(worker_id)s,
    attempted_at = now(),
    -- The first start and every claiming worker, kept for reports (0016).
    started_at = coalesce(j.started_at, now()),
    worker_ids = j.worker_ids || %(worker_id)s::uuid,
    lease_expires_at = now() + %(lease_seconds)s * interval '1 second'
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING j.id, j.queue, j.task, j.args::text, j.priority,
          least(greatest(j.run_at, '0001-01-02'), '9999-12-30'),
          j.attempts, j.max_attempts,
          least(greatest(j.created_at, '0001-01-02'), '9999-12-30'), j.meta::text
"""

# The same claim resumed after a position: the row comparison is an index condition, so
# the scan starts at the cursor instead of walking every entry that earlier claims
# consumed. While a long transaction anywhere holds back VACUUM, those entries cannot be
# removed, and a scan from the start re-reads all of them on every call; this one reads
# each about once. Jobs that appear behind the cursor rewind it through their
# notification, and a probe off the claim path (JOB_BEHIND_CURSOR) finds anything else.
JOB_CLAIM_BATCH_AFTER = JOB_CLAIM_BATCH.replace(
    "AND run_at <= now()\n",
    "AND run_at <= now()\n"
    "      AND (priority, run_at, id)\n"
    "          > (%(after_priority)s::smallint, %(after_run_at)s::timestamptz,\n"
    "             %(after_id)s::bigint)\n",
)
if JOB_CLAIM_BATCH_AFTER == JOB_CLAIM_BATCH:  # pragma: no cover - guards the edit above
    raise RuntimeError("JOB_CLAIM_BATCH changed shape; update JOB_CLAIM_BATCH_AFTER")

# The same two claims for a worker that claims more jobs than it has run permits free:
# each job is marked claimed ahead until its start is recorded (JOB_MARK_STARTED). It may
# wait for a slot and be given back unstarted (sql/complete.py, JOB_GIVE_BACK_UNSTARTED),
# so its queued-scope unique key stays on the row until it really starts (JOB_START_KEYED;
# decision 018): a duplicate is refused meanwhile (0020's index covers running rows), and
# nothing is lost, or needs restoring, when the job goes back or its worker dies.
_CLEAR_QUEUED_KEY = (
    "    -- A queued-scope unique key is released for good once the job starts (0007).\n"
    "    unique_queued_key = NULL,\n"
)


def _claiming_ahead(statement: str) -> str:
    """The claim marking its jobs, keeping their keys, and saying which hold one (an
    eleventh column: JOB_START_KEYED releases it before such a job starts)."""
    ahead = (
        statement.replace("claimed_ahead = false", "claimed_ahead = true")
        .replace(_CLEAR_QUEUED_KEY, "")
        .replace("j.meta::text\n", "j.meta::text, j.unique_queued_key IS NOT NULL\n")
    )
    if "claimed_ahead = true" not in ahead or ahead.count("unique_queued_key") != 1:
        raise RuntimeError("JOB_CLAIM_BATCH changed shape; update _claiming_ahead")
    return ahead


JOB_CLAIM_AHEAD = _claiming_ahead(JOB_CLAIM_BATCH)
JOB_CLAIM_AHEAD_AFTER = _claiming_ahead(JOB_CLAIM_BATCH_AFTER)

# A prefetching worker records, in one statement per batch, that jobs it claimed ahead
# have started and are still running, so that rescue charges them. Written a moment
# after they start, and only for jobs still running then: most jobs finish first, and
# their outcome is all that is written. Fenced like an outcome. SKIP LOCKED: a row another
# transaction has locked is not waited for; it is not returned, and asked for again.
JOB_MARK_STARTED = (
    """
UPDATE {jobs} AS j
SET claimed_ahead = false
WHERE j.id = ANY(ARRAY(
    SELECT k.id FROM {jobs} AS k
    WHERE k.id = ANY(%(ids)s::bigint[]) AND k.claimed_ahead
    FOR UPDATE SKIP LOCKED))
  AND """
    + HELD
    + """
RETURNING j.id
"""
)

# A job claimed ahead that holds a queued-scope unique key starts only once this has
# released the key (and recorded the start): from then on a duplicate is a new job, as it
# would have been had the claim released it. One round trip before the start, for these
# jobs only. No claimed_ahead test: a job given back and claimed again by this worker
# under the same attempt is marked by both its tasks, and the stale one then finds it is
# no longer the job's holder (worker/leased.py). SKIP LOCKED: a row another transaction
# has locked comes back as not marked, and is asked again.
JOB_START_KEYED = """
UPDATE {jobs} AS j
SET claimed_ahead = false,
    unique_queued_key = NULL
WHERE j.id = ANY(ARRAY(SELECT k.id FROM {jobs} AS k WHERE k.id = %(id)s FOR UPDATE SKIP LOCKED))
  AND j.attempts = %(attempt)s
  AND j.worker_id = %(worker_id)s
RETURNING j.id
"""

# Whether a job claimed ahead is still this worker's, asked before it starts when the
# worker has not heard from the database for a while (worker/leased.py): cut off, it may
# have been rescued and run elsewhere meanwhile. A plain read: no lock, never waits.
JOB_STILL_CLAIMED = """
SELECT 1 FROM {jobs}
WHERE id = %(id)s AND worker_id = %(worker_id)s AND attempts = %(attempt)s
"""

# The probe for a lease-mode cursor, run off the claim path every few seconds: the first
# ready job behind the cursor, if any (one that no notification announced, or that a claim
# skipped while another transaction held its row), or at it: the cursor rests on the last
# job claimed, which can be ready again (given back, retried by hand) while claims resume
# strictly after it. The index condition bounds the scan at the cursor; under a held-back
# VACUUM it walks the consumed entries before it, but no claim waits for that.
JOB_BEHIND_CURSOR = """
SELECT priority, run_at, id
FROM {jobs}
WHERE queue = %(queue)s
  AND state = 'available'
  AND run_at <= now()
  AND task <> ALL(%(exclude_tasks)s::text[])
  AND (priority, run_at, id)
      <= (%(after_priority)s::smallint, %(after_run_at)s::timestamptz, %(after_id)s::bigint)
ORDER BY priority, run_at, id
LIMIT 1
"""

# Transactional mode: lock ready rows and leave them as they are. The row lock is the
# claim; it lasts exactly as long as the caller's transaction, so a crash rolls everything
# back and the job is claimable again with attempts unchanged.
# Transactional jobs are never 'running', so only a rate limit binds them: governed says
# the caller reserved the queue's rate first (QueueLimits.reserve).
JOB_LOCK_BATCH = """
SELECT id, queue, task, args::text, priority,
       least(greatest(run_at, '0001-01-02'), '9999-12-30'), attempts, max_attempts,
       least(greatest(created_at, '0001-01-02'), '9999-12-30'), meta::text
FROM {jobs}
WHERE queue = %(queue)s
  AND state = 'available'
  AND run_at <= now()
  AND task = ANY(%(tasks)s::text[])
  AND NOT EXISTS (SELECT 1 FROM {queues} WHERE name = %(queue)s
                  AND (paused OR NOT %(governed)s AND rate_limit IS NOT NULL))
ORDER BY priority, run_at, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""

# Limited queues (0008) claim in a transaction that takes turns on the queue's row: this
# statement locks it and refills its token bucket, and the statements after it (their
# snapshots taken once the lock is held) count the queue's running jobs and claim at most
# what both limits leave. Queues without limits never run any of this.
QUEUE_GOVERN = """
UPDATE {queues} AS q
SET rate_window = ARRAY(SELECT t FROM unnest(q.rate_window) AS t
                        WHERE t > c.at - q.rate_period * interval '1 second' ORDER BY t)
FROM (SELECT clock_timestamp() AS at) AS c
WHERE q.name = %(queue)s
RETURNING q.concurrency_limit,
          q.rate_limit - cardinality(q.rate_window),
          extract(epoch FROM q.rate_window[1] + q.rate_period * interval '1 second' - c.at)
"""

# Only started jobs count against a concurrency limit: jobs claimed ahead that wait at a
# worker's gate would otherwise hold the queue back for every worker (decision 018). A
# limited queue is never claimed ahead (worker/leased.py), so its rows carry the mark only
# if they were claimed before the worker knew of the limit.
QUEUE_RUNNING = """
SELECT count(*) FROM {jobs} WHERE queue = %(queue)s AND state = 'running' AND NOT claimed_ahead
"""

QUEUE_RATE_SPEND = """
UPDATE {queues}
SET rate_window = rate_window || array_fill(clock_timestamp(), ARRAY[%(spent)s::int])
WHERE name = %(queue)s
"""

# Which of a worker's queues have limits; read at start, on a 'limits' control message and
# now and then.
QUEUE_LIMITS = """
SELECT name FROM {queues}
WHERE name = ANY(%(queues)s::text[])
  AND (concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL)
"""
