"""Durable steps (0028): what a job's earlier attempts recorded, and recording a step."""

from skiplock.sql.fence import HELD

# Every step a job's attempts recorded, to answer this attempt's steps from.
STEPS_OF_JOB = """
SELECT name, result::text FROM {job_steps} WHERE job_id = %(id)s
"""

# A lease-mode attempt records a step only while it still holds its job (the fence of
# every worker write): one that lost its lease records nothing. %(batch)s names the
# attempt as the outcome statements do. A name recorded already (by an attempt that
# overlapped this one) is kept: it comes back as not recorded, and is read back.
STEP_RECORD_IF_HELD = (
    """
INSERT INTO {job_steps} (job_id, name, attempt, result)
SELECT j.id, %(name)s, j.attempts, %(result)s::jsonb
FROM {jobs} AS j
WHERE j.id = %(id)s
  AND """
    + HELD
    + """
ON CONFLICT (job_id, name) DO NOTHING
RETURNING job_id
"""
)

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
