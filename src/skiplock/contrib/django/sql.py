"""The Django backend's own statement: a job read as a task result, live or finished.

Values the backend decodes itself come back as text: Django's psycopg connection loads
jsonb as text (its JSONField decodes), and a cast makes that explicit whatever the
connection's loaders are. Timestamps are left to the connection, so that they come back
as Django's settings want them (aware in UTC with USE_TZ, naive local time without).
"""

# The live table first: a job is in one table or the other, and a live one is the common
# case while someone waits on it. History has no run_at and no worker of its own.
JOB_RESULT_GET = """
SELECT id, queue, task, args::text, state, priority, run_at, attempts, errors::text,
       worker_ids::text[], created_at, started_at, attempted_at,
       NULL::timestamptz AS finished_at, NULL::text AS result
FROM {jobs} WHERE id = %(id)s
UNION ALL
SELECT id, queue, task, args::text, state, priority, NULL, attempts, errors::text,
       worker_ids::text[], created_at, started_at, attempted_at, finished_at, result::text
FROM {history} WHERE id = %(id)s
LIMIT 1
"""
