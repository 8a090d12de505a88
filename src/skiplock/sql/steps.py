"""Durable steps (0028): what a job's earlier attempts recorded, and recording a step."""

# Every step the attempts of these jobs recorded, to answer their current attempts'
# steps from (the worker asks for the jobs whose first step came in the same moment).
STEPS_OF_JOBS = """
SELECT job_id, name, result::text FROM {job_steps} WHERE job_id = ANY(%(ids)s::bigint[])
"""

# Lease-mode attempts record their steps only while they still hold their jobs: the fence
# of every worker write (sql/fence.py), applied to each given row with its own attempt,
# since a batch gathers the steps of many jobs. A step of an attempt that lost its job is
# not written. A name recorded already (by an attempt that overlapped this one) is kept.
# Rows come back for the steps written.
STEPS_RECORD_IF_HELD = """
INSERT INTO {job_steps} (job_id, name, attempt, result)
SELECT g.job_id, g.name, g.attempt, g.result::jsonb
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(names)s::text[], %(results)s::text[])
     AS g(job_id, attempt, name, result)
WHERE EXISTS (SELECT 1 FROM {jobs} AS j
              WHERE j.id = g.job_id AND j.attempts = g.attempt
                AND j.worker_id = %(worker_id)s)
ON CONFLICT (job_id, name) DO NOTHING
RETURNING job_id, name
"""

# A transactional attempt holds its job's row for its whole transaction: the step's
# record commits with the job, or rolls back with a failed attempt's savepoint.
STEP_RECORD_LOCKED = """
INSERT INTO {job_steps} (job_id, name, attempt, result)
VALUES (%(id)s, %(name)s, %(attempt)s, %(result)s::jsonb)
ON CONFLICT (job_id, name) DO NOTHING
RETURNING job_id
"""

# For `jobs show`: a job's steps in the order they were recorded.
STEPS_SHOW = """
SELECT name, attempt, result::text, done_at FROM {job_steps}
WHERE job_id = %(id)s ORDER BY done_at, name
"""

# History maintenance: steps of jobs that ended before the cutoff (their job is gone
# from the live table), a batch at a time.
STEPS_PRUNE = """
DELETE FROM {job_steps}
WHERE (job_id, name) IN (
    SELECT s.job_id, s.name FROM {job_steps} AS s
    WHERE s.done_at < %(before)s
      AND NOT EXISTS (SELECT 1 FROM {jobs} AS j WHERE j.id = s.job_id)
    LIMIT %(limit)s)
"""
