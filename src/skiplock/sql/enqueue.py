"""Putting jobs into the table, inside the caller's transaction."""

# now() is the caller's transaction start; a delay counts from there.
JOB_INSERT = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, max_attempts)
VALUES (%(queue)s, %(task)s, %(args)s::jsonb, %(priority)s,
        COALESCE(%(run_at)s, now() + %(delay)s * interval '1 second'), %(max_attempts)s)
RETURNING id
"""

# One statement for a whole batch: parallel arrays through unnest, so the statement-level
# trigger sends one notification per queue however many rows go in.
JOB_INSERT_MANY = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, max_attempts)
SELECT q, t, a::jsonb, p, COALESCE(r, now() + d * interval '1 second'), m
FROM unnest(%(queues)s::text[], %(tasks)s::text[], %(args)s::text[], %(priorities)s::smallint[],
            %(run_ats)s::timestamptz[], %(delays)s::float8[], %(max_attempts)s::int[])
     AS u(q, t, a, p, r, d, m)
RETURNING id
"""

# Bulk path for callers who do not need ids back: COPY is the fastest way in.
JOB_COPY_IN = """
COPY {jobs} (queue, task, args, priority, run_at, max_attempts) FROM STDIN
"""
