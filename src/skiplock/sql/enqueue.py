"""Putting jobs into the table, inside the caller's transaction."""

# now() is the caller's transaction start; a delay counts from there. A job due later is
# 'scheduled', outside the claim index until the promoter makes it available.
JOB_INSERT = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, state, max_attempts)
SELECT %(queue)s, %(task)s, %(args)s::jsonb, %(priority)s, r,
       CASE WHEN r > now() THEN 'scheduled' ELSE 'available' END, %(max_attempts)s
FROM (SELECT COALESCE(%(run_at)s, now() + %(delay)s * interval '1 second') AS r) AS due
RETURNING id
"""

# One statement for a whole batch: parallel arrays through unnest, so the statement-level
# trigger sends one notification per queue however many rows go in.
JOB_INSERT_MANY = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, state, max_attempts)
SELECT q, t, a::jsonb, p, due, CASE WHEN due > now() THEN 'scheduled' ELSE 'available' END, m
FROM unnest(%(queues)s::text[], %(tasks)s::text[], %(args)s::text[], %(priorities)s::smallint[],
            %(run_ats)s::timestamptz[], %(delays)s::float8[], %(max_attempts)s::int[])
     AS u(q, t, a, p, r, d, m),
     LATERAL (SELECT COALESCE(r, now() + d * interval '1 second') AS due) AS l
RETURNING id
"""

# Bulk path for callers who do not need ids back: COPY is the fastest way in.
JOB_COPY_IN = """
COPY {jobs} (queue, task, args, priority, run_at, state, max_attempts) FROM STDIN
"""
