"""Putting jobs into the table, inside the caller's transaction."""

# now() is the caller's transaction start; a delay counts from there. A job due later is
# 'scheduled', outside the claim index until the promoter makes it available. A keyed job
# waits as 'blocked' until admission (sql/keys.py) makes it one or the other.
JOB_INSERT = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, state, max_attempts, ordering_key,
                    key_limit, key_rate, key_period)
SELECT %(queue)s, %(task)s, %(args)s::jsonb, %(priority)s, r,
       CASE WHEN %(ordering_key)s::text IS NOT NULL THEN 'blocked'
            WHEN r > now() THEN 'scheduled' ELSE 'available' END,
       %(max_attempts)s, %(ordering_key)s, %(key_limit)s, %(key_rate)s, %(key_period)s
FROM (SELECT COALESCE(%(run_at)s, now() + %(delay)s * interval '1 second') AS r) AS due
RETURNING id
"""

# A unique job: the insert does nothing when a live job in the key's scope holds it. The
# caller then looks the holder up with JOB_FIND_UNIQUE in a new statement: if the insert
# waited on a concurrent holder, this statement's snapshot cannot see it.
# No statement here names the id column: the id is the table's own default, so no id
# written by hand can collide with it, and an enqueue-only role may not write one at all
# (decision 022).
JOB_INSERT_UNIQUE = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, state, max_attempts, unique_key,
                    unique_queued_key, ordering_key, key_limit, key_rate, key_period)
SELECT %(queue)s, %(task)s, %(args)s::jsonb, %(priority)s, r,
       CASE WHEN %(ordering_key)s::text IS NOT NULL THEN 'blocked'
            WHEN r > now() THEN 'scheduled' ELSE 'available' END,
       %(max_attempts)s, %(unique_key)s, %(unique_queued_key)s, %(ordering_key)s, %(key_limit)s,
       %(key_rate)s, %(key_period)s
FROM (SELECT COALESCE(%(run_at)s, now() + %(delay)s * interval '1 second') AS r) AS due
ON CONFLICT DO NOTHING
RETURNING id
"""

# A windowed key (0009): take it if nobody holds it or its window has passed. Nothing
# returned: held; JOB_FIND_WINDOW names the holder. The window is taken for a stand-in id
# from the jobs sequence (an id no job will ever have); JOB_INSERT_WINDOWED then inserts
# the job and points the window at it, or, refused by the scope's index,
# JOB_WINDOW_GIVE_BACK frees the window again.
JOB_WINDOW_TAKE = """
INSERT INTO {unique_windows} (key, job_id, expires_at)
VALUES (%(unique_key)s,
        nextval((SELECT pg_get_serial_sequence(%(table)s, 'id'))::regclass),
        now() + %(window)s * interval '1 second')
ON CONFLICT (key) DO UPDATE
SET job_id = EXCLUDED.job_id, expires_at = EXCLUDED.expires_at
WHERE {unique_windows}.expires_at <= now()
RETURNING job_id
"""

# JOB_INSERT_UNIQUE, and the window just taken (for the stand-in %(id)s) handed to the new
# job. Another table than the insert's, so the two writes of one statement cannot meet.
JOB_INSERT_WINDOWED = (
    """
WITH job AS ("""
    + JOB_INSERT_UNIQUE.strip()
    + """
), moved AS (
    UPDATE {unique_windows} AS w SET job_id = job.id
    FROM job
    WHERE w.key = %(unique_key)s AND w.job_id = %(id)s
)
SELECT id FROM job
"""
)

JOB_FIND_WINDOW = """
SELECT job_id FROM {unique_windows} WHERE key = %(unique_key)s AND expires_at > now()
"""

JOB_WINDOW_GIVE_BACK = """
DELETE FROM {unique_windows} WHERE key = %(unique_key)s AND job_id = %(id)s
"""

# The holder of a key, in the states its scope's index covers (0007, 0011, 0020): the
# 'queued' scope holds the key while the job waits, for its key (blocked), its time, or a
# slot at the worker that claimed it ahead (running, unstarted).
JOB_FIND_UNIQUE = """
SELECT id FROM {jobs}
WHERE (unique_key = %(unique_key)s AND state <> 'dead')
   OR (unique_queued_key = %(unique_queued_key)s
       AND state IN ('blocked', 'scheduled', 'available', 'retryable', 'running'))
LIMIT 1
"""

# A unique job asked to replace (decision 028), after JOB_INSERT_UNIQUE inserted nothing:
# the waiting holder takes the fields named; NULL when none waits (the caller then looks
# the holder up, or inserts again when it has gone). The run time is computed as the
# insert's is, from the transaction's now().
JOB_REPLACE_WAITING = """
SELECT {schema}.job_replace_waiting(
    %(unique_key)s, %(unique_queued_key)s, %(replace)s::text[], %(args)s::jsonb,
    COALESCE(%(run_at)s, now() + %(delay)s * interval '1 second'), %(priority)s::smallint,
    %(max_attempts)s::integer)
"""

# Unique jobs in bulk: one statement for the batch; duplicates (of live jobs, or within
# the batch) insert nothing, and the caller looks their holders up by key.
JOB_INSERT_MANY_UNIQUE = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, state, max_attempts, unique_key,
                    unique_queued_key, ordering_key, key_limit, key_rate, key_period)
SELECT q, t, a::jsonb, p, due,
       CASE WHEN ok IS NOT NULL THEN 'blocked'
            WHEN due > now() THEN 'scheduled' ELSE 'available' END,
       m, k, qk, ok, kl, kr, kp
FROM unnest(%(queues)s::text[], %(tasks)s::text[], %(args)s::text[], %(priorities)s::smallint[],
            %(run_ats)s::timestamptz[], %(delays)s::float8[], %(max_attempts)s::int[],
            %(unique_keys)s::text[], %(unique_queued_keys)s::text[],
            %(ordering_keys)s::text[], %(key_limits)s::smallint[], %(key_rates)s::int[],
            %(key_periods)s::float8[])
     AS u(q, t, a, p, r, d, m, k, qk, ok, kl, kr, kp),
     LATERAL (SELECT COALESCE(r, now() + d * interval '1 second') AS due) AS l
ON CONFLICT DO NOTHING
RETURNING id, unique_key, unique_queued_key
"""

JOB_FIND_UNIQUE_MANY = """
SELECT id,
       CASE WHEN unique_key = ANY(%(keys)s::text[]) AND state <> 'dead'
            THEN unique_key END,
       CASE WHEN unique_queued_key = ANY(%(queued_keys)s::text[])
             AND state IN ('blocked', 'scheduled', 'available', 'retryable', 'running')
            THEN unique_queued_key END
FROM {jobs}
WHERE (unique_key = ANY(%(keys)s::text[]) AND state <> 'dead')
   OR (unique_queued_key = ANY(%(queued_keys)s::text[])
       AND state IN ('blocked', 'scheduled', 'available', 'retryable', 'running'))
"""

# Bulk enqueue, step one: the transaction's now(), which delays and the
# scheduled/available choice are computed against, exactly as JOB_INSERT does in SQL, and
# an id from the table's sequence that this session took last before the COPY: the COPY's
# rows get theirs after it.
JOB_COPY_BEGIN = """
SELECT now(), nextval((SELECT pg_get_serial_sequence(%(table)s, 'id'))::regclass)
"""

# Step two: COPY, the fastest way in, without ids: each row takes the table's default, in
# the order the rows are sent (decision 022: no id is written by hand, so none collides).
# The statement-level insert trigger fires once for the whole COPY, so workers get one
# notification per queue however many rows.
JOB_COPY_IN = """
COPY {jobs} (queue, task, args, priority, run_at, state, max_attempts) FROM STDIN
"""

# The same with keys, used only when some job in the batch has one.
JOB_COPY_IN_KEYED = """
COPY {jobs} (queue, task, args, priority, run_at, state, max_attempts, ordering_key,
             key_limit, key_rate, key_period) FROM STDIN
"""

# Step three: the ids the COPY's rows took, in the order they were sent. This session's
# nextval calls ascend, so they lie after %(after)s (step one's) and up to currval, the
# COPY's last row's. Other sessions take ids in between: their rows are told apart by
# xmin, which for every row of one COPY is the same (sub)transaction's, the last row's.
# A range of the primary key (three times cheaper than looking each id up): the range
# holds the batch and the ids other sessions took meanwhile, and a plan that reads the
# whole table instead is one where the batch is most of it.
JOB_COPY_IDS = """
WITH last AS (
    SELECT currval((SELECT pg_get_serial_sequence(%(table)s, 'id'))::regclass) AS id
)
SELECT j.id
FROM {jobs} AS j
WHERE j.id > %(after)s AND j.id <= (SELECT id FROM last)
  AND j.xmin = (SELECT k.xmin FROM {jobs} AS k WHERE k.id = (SELECT id FROM last))
ORDER BY j.id
"""

# The statements above with the jobs' meta (0017), used only when something is stored
# there (a trace context: skiplock/tracing.py). A plain enqueue names no column newer
# than the statements above do, so that code of this release still enqueues into a
# schema not yet migrated to 0017 while the migration waits to be run.
_META_EDITS = {
    "JOB_INSERT": (
        ("key_period)\nSELECT", "key_period, meta)\nSELECT"),
        ("%(key_period)s\nFROM", "%(key_period)s, %(meta)s::jsonb\nFROM"),
    ),
    "JOB_INSERT_UNIQUE": (
        ("key_period)\nSELECT", "key_period, meta)\nSELECT"),
        ("%(key_period)s\nFROM", "%(key_period)s, %(meta)s::jsonb\nFROM"),
    ),
    "JOB_INSERT_WINDOWED": (
        ("key_period)\nSELECT", "key_period, meta)\nSELECT"),
        ("%(key_period)s\nFROM", "%(key_period)s, %(meta)s::jsonb\nFROM"),
    ),
    "JOB_INSERT_MANY_UNIQUE": (
        ("key_period)\nSELECT", "key_period, meta)\nSELECT"),
        ("kl, kr, kp\n", "kl, kr, kp, mt::jsonb\n"),
        ("%(key_periods)s::float8[])", "%(key_periods)s::float8[], %(metas)s::text[])"),
        ("ok, kl, kr, kp)", "ok, kl, kr, kp, mt)"),
    ),
    "JOB_COPY_IN": (("max_attempts)", "max_attempts, meta)"),),
    "JOB_COPY_IN_KEYED": (("key_period)", "key_period, meta)"),),
}


def _with_meta(name: str) -> str:
    statement = globals()[name]
    for old, new in _META_EDITS[name]:
        if statement.count(old) != 1:  # pragma: no cover - guards the edits above
            raise RuntimeError(f"{name} changed shape; update its edit in _META_EDITS")
        statement = statement.replace(old, new)
    return str(statement)


JOB_INSERT_META = _with_meta("JOB_INSERT")
JOB_INSERT_UNIQUE_META = _with_meta("JOB_INSERT_UNIQUE")
JOB_INSERT_WINDOWED_META = _with_meta("JOB_INSERT_WINDOWED")
JOB_INSERT_MANY_UNIQUE_META = _with_meta("JOB_INSERT_MANY_UNIQUE")
JOB_COPY_IN_META = _with_meta("JOB_COPY_IN")
JOB_COPY_IN_KEYED_META = _with_meta("JOB_COPY_IN_KEYED")
# Each statement's twin with the meta, for the client to pick by whether it stores one.
WITH_META = {
    JOB_INSERT: JOB_INSERT_META,
    JOB_INSERT_UNIQUE: JOB_INSERT_UNIQUE_META,
    JOB_INSERT_WINDOWED: JOB_INSERT_WINDOWED_META,
    JOB_INSERT_MANY_UNIQUE: JOB_INSERT_MANY_UNIQUE_META,
    JOB_COPY_IN: JOB_COPY_IN_META,
    JOB_COPY_IN_KEYED: JOB_COPY_IN_KEYED_META,
}
