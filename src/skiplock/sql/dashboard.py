"""The web dashboard's reads: pages of jobs, one job in full, throughput, cron schedules.

Every filter is written ``(%(x)s IS NULL OR ...)``. The dashboard's connections never
prepare statements server-side, so each statement is planned with its values, and the
planner drops the filters that are NULL: a filtered page uses the index for its filter
(migration 0018) instead of a generic plan that fits every combination badly.

Pages are keyset-paginated, newest first: ``id < %(before)s ORDER BY id DESC LIMIT n``
reads n rows however deep the page, where OFFSET would read and discard every row before
it (a million on the last page of history).
"""

from skiplock.sql.admin import LIVE_QUEUE_COLUMNS, LIVE_QUEUE_COUNTS, SERVING_WORKERS


def _filters(time_column: str) -> str:
    """The WHERE clause shared by both tables. ``args_text`` is matched against the
    arguments' JSON text (a LIKE pattern built, escaped, by the caller); ``error_type`` against the
    class name of any recorded failure; the time range against ``time_column``: when a
    live job was enqueued, when a finished one finished (the column history is
    partitioned and indexed by, so a range reads only its days). ``errors <> '[]'`` is
    implied by the error filter and written out so that the planner can use the index of
    failed history rows (0018); ``meta ? 'tags'`` likewise for the tag indexes (0032)."""
    return """
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(task)s::text IS NULL OR task = %(task)s)
  AND (%(args_text)s::text IS NULL OR args::text ILIKE %(args_text)s)
  AND (%(error_type)s::text IS NULL
       OR (errors <> '[]'::jsonb
           AND errors @> jsonb_build_array(jsonb_build_object('type', %(error_type)s::text))))
  AND (%(tag)s::text IS NULL
       OR (meta ? 'tags' AND meta -> 'tags' @> %(tag_json)s::jsonb))
  AND (%(time_from)s::timestamptz IS NULL OR {time} >= %(time_from)s)
  AND (%(time_to)s::timestamptz IS NULL OR {time} < %(time_to)s)
  AND (%(before)s::bigint IS NULL OR id < %(before)s)
""".replace("{time}", time_column)


def _page(select: str, time_column: str) -> str:
    """A page, newest first, of the rows ``select`` reads that pass the filters."""
    return select + _filters(time_column) + "ORDER BY id DESC\nLIMIT %(limit)s\n"


# A page of live jobs; the caller asks for one row more than it shows, to know whether
# there is a next page.
JOBS_LIVE_PAGE = _page(
    """
SELECT id, queue, task, args, state, priority, run_at, retry_at, attempts, max_attempts,
       errors, created_at, attempted_at, NULL::timestamptz AS finished_at,
       meta -> 'tags' AS tags, started_at
FROM {jobs}""",
    "created_at",
)

JOBS_HISTORY_PAGE = _page(
    """
SELECT id, queue, task, args, state, priority, NULL::timestamptz AS run_at,
       NULL::timestamptz AS retry_at, attempts, max_attempts, errors, created_at,
       attempted_at, finished_at, meta -> 'tags' AS tags, started_at
FROM {history}""",
    "finished_at",
)

# Every live job matching the filters, for "retry / cancel / delete all matching": the ids
# go to the same client functions the CLI uses. Bounded, so that one click cannot build a
# statement over millions of ids; the page says when the bound was reached.
JOB_IDS_MATCHING = (
    """
SELECT id FROM {jobs}"""
    + _filters("created_at")
    + """ORDER BY id
LIMIT %(limit)s
"""
)

# One job with every column a person may want: its keys and limits, and what it carries
# for skiplock (meta: the enqueuing trace context), which the CLI's JOB_GET leaves out.
JOB_DETAIL = """
SELECT id, queue, task, args, state, priority, run_at, retry_at, attempts, max_attempts,
       errors, worker_id, lease_expires_at, created_at, attempted_at, started_at,
       NULL::timestamptz AS finished_at, NULL::jsonb AS result, progress,
       cancel_requested_at, unique_key, unique_queued_key, ordering_key, key_limit,
       key_rate, key_period, worker_ids, meta, wait_key, wait_until
FROM {jobs} WHERE id = %(id)s
UNION ALL
SELECT id, queue, task, args, state, priority, NULL, NULL, attempts, max_attempts,
       errors, NULL, NULL, created_at, attempted_at, started_at, finished_at, result,
       progress, NULL, unique_key, NULL, ordering_key, NULL, NULL, NULL, worker_ids, meta,
       NULL, NULL
FROM {history} WHERE id = %(id)s
LIMIT 1
"""

# A job's durable steps in the order recorded, the first %(limit)s, each row with the
# job's count of steps.
JOB_STEPS = """
SELECT name, attempt, result, done_at, count(*) OVER () AS count
FROM {job_steps} WHERE job_id = %(id)s
ORDER BY done_at, name
LIMIT %(limit)s
"""

# Jobs finished per minute over the last hour, by outcome. Reads only the last hour's
# partition(s) through the finished_at index. Failures are the errors recorded in the
# hour, wherever their job is now.
THROUGHPUT_LAST_HOUR = """
SELECT date_trunc('minute', finished_at) AS minute, state, count(*) AS jobs
FROM {history}
WHERE finished_at >= date_trunc('minute', now()) - interval '59 minutes'
GROUP BY 1, 2
ORDER BY 1
"""

# The overview's last hour per queue: jobs completed and cancelled (history, finished in
# the hour: only its partitions are read), and jobs whose latest attempt, claimed in the
# hour, failed (live: retryable or dead now). Nothing here parses a stored record, so a
# row written by hand cannot break the page.
QUEUE_LAST_HOUR = """
SELECT queue, sum(completed)::bigint AS completed_hour,
       sum(cancelled)::bigint AS cancelled_hour, sum(failed)::bigint AS failed_hour
FROM (
    SELECT queue, count(*) FILTER (WHERE state = 'completed') AS completed,
           count(*) FILTER (WHERE state = 'cancelled') AS cancelled, 0 AS failed
    FROM {history}
    WHERE finished_at >= now() - interval '1 hour'
    GROUP BY queue
    UNION ALL
    SELECT queue, 0, 0, count(*)
    FROM {jobs}
    WHERE state IN ('retryable', 'dead') AND attempted_at >= now() - interval '1 hour'
    GROUP BY queue
) AS hour
GROUP BY queue
"""

# The database's clock, so the chart's minutes and "ago" figures agree with the rows.
DASHBOARD_NOW = """
SELECT now()
"""

# Busy slots per worker: its running jobs, through the rescuer's index on running jobs.
WORKER_BUSY = """
SELECT worker_id, count(*) FROM {jobs} WHERE state = 'running' GROUP BY worker_id
"""

# The overview's counts per queue: the live part of the CLI's QUEUE_STATS (same states,
# same oldest-ready rule) in one pass over the jobs table, without its last-minute failure
# figures, which expand every recent job's errors and read the table a second time; the
# chart shows finished jobs instead.
QUEUE_COUNTS = (
    """
WITH live AS (
"""
    + LIVE_QUEUE_COUNTS
    + """), serving AS (
"""
    + SERVING_WORKERS
    + """
)
SELECT queue,"""
    + LIVE_QUEUE_COLUMNS
    + """
       coalesce(s.workers, 0) AS workers
FROM live AS l
FULL JOIN serving AS s USING (queue)
ORDER BY queue
"""
)

# Text in the arguments is matched by casting each row's jsonb to text, the costliest
# test here (about 2 us a row), and an error class by reading each row's errors.
# PostgreSQL cannot estimate how many rows such a test passes and guesses very few, so it
# plans to read the whole live table and sort the matches; when many rows match, reading
# in id order and stopping at a page's worth is far cheaper (text at 100,000 live jobs:
# 10 ms instead of 200). For these two filters only, in the page's own transaction,
# sequential scans are made a last resort (history's indexes, 0018, are used either way).
JOBS_SCAN_IN_ORDER = """
SET LOCAL enable_seqscan = off
"""
