"""Workflows (migration 0022, decision 024): enqueueing one, reading a step's parents'
results, and the operator's reads. Release is not here: the trigger of the statement
that ends a step's last parent does it (workflow_steps_end in 0022)."""

# A whole workflow in one statement, in the caller's transaction: its row, its steps'
# jobs, and the steps' rows with their parents and children as job ids. The steps come
# as one JSON array of objects, one per step and numbered (parsed once, by the server, faster than
# psycopg formats a dozen arrays of ten thousand elements). The jobs are inserted sorted
# by the steps' ordinality: the identity default is evaluated on the sorted rows, so the
# ids ascend in step order (other sessions' ids may fall in between, as for bulk
# enqueue's COPY), and the ids in order are one array that each step's parents and
# children (step numbers from 1, as text: "1,2,3") index into. No join between the
# steps: planned as joins, their estimates (thousands times thousands) made the planner
# compile the statement (JIT) for seconds. Steps with parents wait as 'waiting'; the
# others are written as any enqueue writes them. The insert trigger wakes workers for
# the roots.
WORKFLOW_INSERT = """
WITH workflow AS (
    INSERT INTO {workflows} (name, options, steps, steps_left)
    VALUES (%(name)s, %(options)s::jsonb, %(steps)s, %(steps)s)
    RETURNING id
), given AS MATERIALIZED (
    SELECT *
    FROM json_to_recordset(%(given)s::json)
         AS u(q text, t text, a text, p smallint, r timestamptz, d float8,
                              m int, ok text, kl smallint, kr int, kp float8, w int,
                              name text, anyway boolean, up text, down text, n bigint)
), inserted AS (
    INSERT INTO {jobs} (queue, task, args, priority, run_at, state, max_attempts,
                        ordering_key, key_limit, key_rate, key_period, workflow_id)
    SELECT u.q, u.t, u.a::jsonb, u.p, l.due,
           CASE WHEN u.w > 0 THEN 'waiting'
                WHEN u.ok IS NOT NULL THEN 'blocked'
                WHEN l.due > now() THEN 'scheduled' ELSE 'available' END,
           u.m, u.ok, u.kl, u.kr, u.kp, (SELECT id FROM workflow)
    FROM given AS u,
         LATERAL (SELECT COALESCE(u.r, now() + u.d * interval '1 second') AS due) AS l
    ORDER BY u.n
    RETURNING id
), ids AS (
    SELECT array_agg(id ORDER BY id) AS ids FROM inserted
), steps AS (
    INSERT INTO {workflow_steps} (job_id, workflow_id, name, parents, children, pending,
                                  run_anyway, key_limit, key_rate, key_period)
    SELECT ids.ids[u.n], (SELECT id FROM workflow), u.name,
           ARRAY(SELECT ids.ids[x::int] FROM unnest(string_to_array(u.up, ',')) AS x),
           ARRAY(SELECT ids.ids[x::int] FROM unnest(string_to_array(u.down, ',')) AS x),
           u.w, u.anyway, u.kl, u.kr, u.kp
    FROM ids, given AS u
    RETURNING job_id
)
SELECT (SELECT id FROM workflow), (SELECT ids FROM ids), (SELECT count(*) FROM steps)
"""

# A step's parents, by name, with how each ended: the result from history for a
# completed one, the last error for one that failed (dead: still in jobs; cancelled: in
# history). A parent still live (a step that runs anyway never waits for that: only
# asked about out of turn) comes back with its state.
STEP_PARENT_RESULTS = """
SELECT p.name,
       coalesce(h.state, j.state) AS state,
       h.result,
       coalesce(h.errors, j.errors) -> -1 AS last_error
FROM {workflow_steps} AS s
CROSS JOIN LATERAL unnest(s.parents) AS parent(id)
JOIN {workflow_steps} AS p ON p.job_id = parent.id
LEFT JOIN LATERAL (SELECT x.state, x.result, x.errors FROM {history} AS x
                   WHERE x.id = parent.id LIMIT 1) AS h ON true
LEFT JOIN {jobs} AS j ON j.id = parent.id
WHERE s.job_id = %(id)s
ORDER BY p.name
"""

WORKFLOW_GET = """
SELECT id, name, state, options, steps, steps_left, steps_failed, created_at, finished_at
FROM {workflows} WHERE id = %(id)s
"""

WORKFLOW_LIST = """
SELECT id, name, state, options, steps, steps_left, steps_failed, created_at, finished_at
FROM {workflows}
WHERE (%(state)s::text IS NULL OR state = %(state)s)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
"""

# Each step of a workflow with its job's state: live, or from history.
WORKFLOW_STEPS = """
SELECT s.job_id, s.name, s.parents, s.pending, s.run_anyway, s.outcome,
       coalesce(j.state, h.state) AS state, coalesce(j.task, h.task) AS task,
       coalesce(j.attempts, h.attempts) AS attempts, h.finished_at
FROM {workflow_steps} AS s
LEFT JOIN {jobs} AS j ON j.id = s.job_id
LEFT JOIN LATERAL (SELECT x.state, x.task, x.attempts, x.finished_at FROM {history} AS x
                   WHERE x.id = s.job_id LIMIT 1) AS h ON j.id IS NULL
WHERE s.workflow_id = %(id)s
ORDER BY s.job_id
"""

# Cancelling a workflow: marked cancelled first (WORKFLOW_CANCEL), so that the steps
# ended by the statements after it leave it so; then its steps that are not running go
# to history as cancelled (WORKFLOW_STEPS_CANCEL: the DELETE's trigger counts them as
# ended), and its running ones are asked to stop as `jobs cancel` asks
# (admin.JOB_CANCEL_RUNNING, by WORKFLOW_RUNNING_STEPS' ids). A workflow's steps are
# found by a scan of the live jobs: the hot table is small, and an index of
# workflow_id would be written by every step's every move.
WORKFLOW_CANCEL = """
UPDATE {workflows}
SET state = 'cancelled', finished_at = coalesce(finished_at, now())
WHERE id = %(id)s AND state = 'running'
RETURNING id
"""

WORKFLOW_STEPS_CANCEL = """
WITH gone AS (
    DELETE FROM {jobs}
    WHERE workflow_id = %(id)s
      AND state IN ('waiting', 'blocked', 'scheduled', 'available', 'retryable', 'dead')
    RETURNING *
)
INSERT INTO {history} (id, queue, task, args, state, priority, attempts, max_attempts, errors,
                       result, unique_key, ordering_key, created_at, attempted_at, progress,
                       started_at, worker_ids, meta)
SELECT id, queue, task, args, 'cancelled', priority, attempts, max_attempts,
       errors || jsonb_build_array(jsonb_build_object(
           'attempt', attempts, 'at', now(), 'type', 'Cancelled',
           'message', 'its workflow was cancelled', 'traceback', NULL)),
       NULL, unique_key, ordering_key, created_at, attempted_at, progress, started_at,
       worker_ids, meta
FROM gone
RETURNING id
"""

WORKFLOW_RUNNING_STEPS = """
SELECT id FROM {jobs} WHERE workflow_id = %(id)s AND state = 'running' ORDER BY id
"""
