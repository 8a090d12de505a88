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

# Bulk enqueue, step one: ids from the table's own sequence (so plain INSERTs never
# collide with them) and the transaction's now(), which delays and the scheduled/available
# choice are computed against, exactly as JOB_INSERT does in SQL.
JOB_IDS_RESERVE = """
SELECT now(), array(
    SELECT nextval((SELECT pg_get_serial_sequence(%(table)s, 'id'))::regclass)
    FROM generate_series(1, %(count)s))
"""

# Step two: COPY, the fastest way in. The statement-level insert trigger fires once for
# the whole COPY, so workers get one notification per queue however many rows.
JOB_COPY_IN = """
COPY {jobs} (id, queue, task, args, priority, run_at, state, max_attempts) FROM STDIN
"""
