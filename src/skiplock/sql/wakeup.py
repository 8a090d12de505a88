"""How a worker gets woken without costing every insert a notification (decision 023).

An insert notifies only while its queue has a sentinel: a worker session holding the
queue's "waiting" key exclusively (0021's trigger tries it shared, and notifies when that
fails). Keys are bigints derived from the schema and the queue, in the same way here and
in the trigger. A second key, "sentinel", is held exclusively alongside it, so that a
worker that cannot take the waiting key can tell a sentinel that is already there from an
insert still in flight.
"""

from skiplock.sql.claim import WORKER_SESSION_OPTIONS

# The wake-up session runs as worker sessions do, and without sorts besides: each part of
# JOB_LATE_COMMITS reads jobs_enqueued in its own order, and only an index scan of it can
# give that order without a sort. Statistics taken while VACUUM is held back may say the
# table is tiny, and then sorting a walk of jobs_claim looks as cheap (test_claim_plan.py).
WAKEUP_SESSION_OPTIONS = WORKER_SESSION_OPTIONS + " -c enable_sort=off"

# The two keys of a queue, derived as the insert trigger derives the waiting key (0021).
_KEYS = """
FROM (SELECT hashtextextended(%(queue)s, hashtextextended(%(schema)s || '.waiting', 0)),
             hashtextextended(%(queue)s, hashtextextended(%(schema)s || '.sentinel', 0)))
     AS k(waiting, sentinel)
"""

# Become the queue's sentinel, if nothing stands in the way. Nested CASEs fix the order in
# which the locks are tried (AND and OR do not). Answers:
#   'armed'     both keys taken: from now on every insert into the queue notifies, and
#               every insert that did not has ended, so one more claim finds its job;
#   'covered'   another session is the sentinel: its notifications wake this worker too;
#   'in flight' an inserting transaction holds the waiting key shared: its job is not
#               visible yet, and it will not notify; claim again soon.
# A waiting key taken without the sentinel key (a session that tests the sentinel key holds
# it shared for an instant) is let go again, and counts as in flight.
SENTINEL_ARM = (
    """
SELECT CASE
    WHEN pg_try_advisory_lock(k.waiting) THEN CASE
        WHEN pg_try_advisory_lock(k.sentinel) THEN 'armed'
        WHEN pg_advisory_unlock(k.waiting) THEN 'in flight'
        ELSE 'in flight'
        END
    WHEN pg_try_advisory_lock_shared(k.sentinel) THEN CASE
        WHEN pg_advisory_unlock_shared(k.sentinel) THEN 'in flight'
        ELSE 'in flight'
        END
    ELSE 'covered'
    END"""
    + _KEYS
)

# Stop being the queue's sentinel: inserts stop notifying. The waiting key goes first, so a
# session testing the sentinel key meanwhile sees a sentinel a moment longer, never a gap.
SENTINEL_DISARM = "SELECT pg_advisory_unlock(k.waiting), pg_advisory_unlock(k.sentinel)" + _KEYS

# The same, telling the queue's other workers: they took this session for their sentinel
# ('covered') and sleep on its notifications, which stop now, though nothing woke them.
# So they claim, and one of them arms. The position (the lowest priority) rewinds no cursor.
SENTINEL_HAND_OVER = (
    "SELECT pg_advisory_unlock(k.waiting), pg_advisory_unlock(k.sentinel), "
    "pg_notify(%(channel)s, %(queue)s || E'\\t32767\\t' || extract(epoch FROM now()))" + _KEYS
)


def _late_part(after: str) -> str:
    """A part of JOB_LATE_COMMITS: per row of ``a``, at most ``limit`` of its queue's
    available jobs in jobs_enqueued's order, from where ``after`` starts them."""
    return (
        """
    CROSS JOIN LATERAL (
        SELECT j.enqueued_xid, j.id, j.priority, j.run_at,
               j.run_at <= now() AND j.task <> ALL(%(exclude_tasks)s::text[]) AS ready
        FROM {jobs} AS j
        WHERE j.queue = a.queue
          AND j.state = 'available'
          AND j.enqueued_xid IS NOT NULL"""
        + after
        + """
        ORDER BY j.enqueued_xid, j.id
        LIMIT %(limit)s
    ) AS r"""
    )


# Jobs that became visible since the previous probe, behind a busy worker's claim cursor or
# not: those inserted by a transaction that was in progress at the previous probe's snapshot
# (its xip list, "pending") or began after it (xid at or above its xmax, "recent"). Read
# through jobs_enqueued (0021) in its own order, so each queue's read starts at the recent
# end of the index, and its cost follows what was inserted since, not what VACUUM could not
# remove yet; a transaction held open elsewhere stays pending and costs one index probe per
# call. At most `limit` jobs per queue and transaction are read: the answer says where a
# read stopped (`last_xid`, `last_id`: it resumes there) and how many it read, and gives the
# first ready job of each part (the claim order). Then this statement's own snapshot
# (`snapshot`: its xmax; `xip`: one row per transaction in progress) for the next probe.
# The first call of a worker passes no queue: its claims start from the beginning anyway.
JOB_LATE_COMMITS = (
    """
WITH recent AS (
    SELECT a.queue, r.*
    FROM unnest(%(queues)s::text[], %(xmax)s::xid8[], %(after_id)s::bigint[])
         AS a(queue, xmax, after_id)"""
    + _late_part("""
          AND (j.enqueued_xid, j.id) > (a.xmax, a.after_id)""")
    + """
), pending AS (
    SELECT a.queue, r.*
    FROM unnest(%(p_queues)s::text[], %(p_xids)s::xid8[], %(p_after_id)s::bigint[])
         AS a(queue, xid, after_id)"""
    + _late_part("""
          -- The transaction's jobs after after_id, in the index's order: written as two
          -- row comparisons, not an equality, so that no other index can serve them.
          AND (j.enqueued_xid, j.id) > (a.xid, a.after_id)
          AND (j.enqueued_xid, j.id) <= (a.xid, 9223372036854775807)""")
    + """
), parts AS (
    SELECT 'recent' AS part, * FROM recent
    UNION ALL
    SELECT 'pending', * FROM pending
)
SELECT part, queue, max(enqueued_xid)::text, count(*),
       (array_agg(id ORDER BY enqueued_xid DESC, id DESC))[1],
       (array_agg(priority ORDER BY priority, run_at, id) FILTER (WHERE ready))[1],
       (array_agg(least(greatest(run_at, '0001-01-02'), '9999-12-30')
                  ORDER BY priority, run_at, id) FILTER (WHERE ready))[1],
       (array_agg(id ORDER BY priority, run_at, id) FILTER (WHERE ready))[1]
FROM parts
GROUP BY part, queue, CASE WHEN part = 'pending' THEN enqueued_xid END
UNION ALL
SELECT 'snapshot', NULL, pg_snapshot_xmax(pg_current_snapshot())::text, NULL, NULL, NULL,
       NULL, NULL
UNION ALL
SELECT 'xip', NULL, x::text, NULL, NULL, NULL, NULL, NULL
FROM pg_snapshot_xip(pg_current_snapshot()) AS x
"""
)
