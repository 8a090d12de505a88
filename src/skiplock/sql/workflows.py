"""Workflows (migration 0022, decision 024): enqueueing one, reading a step's parents'
results, and the operator's reads. Release is not here: the trigger of the statement
that ends a step's last parent does it (workflow_steps_end in 0022)."""

# A whole workflow in one statement, in the caller's transaction: its row, its steps'
# jobs, and the steps' rows. The steps come as one JSON object of columns, an array per
# column with one element per step (parsed once into jsonb by the server; psycopg's
# formatting of a dozen arrays of ten thousand elements cost more than the insert), read
# back row by row with ROWS FROM, which zips the columns by position. A step's parents
# and children are step numbers (from 1): written as given, no mapping to job ids. The
# jobs are inserted sorted by step number: the identity default is evaluated on the
# sorted rows, so the ids ascend in step order (other sessions' ids may fall in
# between, as for bulk enqueue's COPY), and the i-th id is step i's. Steps with parents
# wait as 'waiting'; the others are written as any enqueue writes them. The insert
# trigger wakes workers for the roots.
# The steps given, one row each (n from 1), from the JSON object of columns. A column whose
# value is the same for every step comes once, under "all" (workflow.step_columns): ROWS
# FROM pads the missing array with NULLs, and the value fills them.
_GIVEN = """
doc AS (
    SELECT %(given)s::jsonb AS g
), given AS MATERIALIZED (
    SELECT coalesce(u.q, doc.g #>> '{{all,q}}') AS q,
           coalesce(u.t, doc.g #>> '{{all,t}}') AS t,
           coalesce(u.a, doc.g #>> '{{all,a}}') AS a,
           coalesce(u.p, doc.g #>> '{{all,p}}') AS p,
           coalesce(u.r, doc.g #>> '{{all,r}}') AS r,
           coalesce(u.d, doc.g #>> '{{all,d}}') AS d,
           coalesce(u.m, doc.g #>> '{{all,m}}') AS m,
           coalesce(u.ok, doc.g #>> '{{all,ok}}') AS ok,
           coalesce(u.kl, doc.g #>> '{{all,kl}}') AS kl,
           coalesce(u.kr, doc.g #>> '{{all,kr}}') AS kr,
           coalesce(u.kp, doc.g #>> '{{all,kp}}') AS kp,
           coalesce(u.w, doc.g #>> '{{all,w}}') AS w,
           coalesce(u.uk, doc.g #>> '{{all,uk}}') AS uk,
           coalesce(u.name, doc.g #>> '{{all,name}}') AS name,
           coalesce(u.anyway, doc.g #>> '{{all,anyway}}') AS anyway,
           coalesce(u.up, doc.g #>> '{{all,up}}') AS up,
           coalesce(u.down, doc.g #>> '{{all,down}}') AS down,
           coalesce(u.tg, doc.g #>> '{{all,tg}}') AS tg,
           u.n
    FROM doc,
         ROWS FROM (jsonb_array_elements_text(doc.g -> 'q'),
                    jsonb_array_elements_text(doc.g -> 't'),
                    jsonb_array_elements_text(doc.g -> 'a'),
                    jsonb_array_elements_text(doc.g -> 'p'),
                    jsonb_array_elements_text(doc.g -> 'r'),
                    jsonb_array_elements_text(doc.g -> 'd'),
                    jsonb_array_elements_text(doc.g -> 'm'),
                    jsonb_array_elements_text(doc.g -> 'ok'),
                    jsonb_array_elements_text(doc.g -> 'kl'),
                    jsonb_array_elements_text(doc.g -> 'kr'),
                    jsonb_array_elements_text(doc.g -> 'kp'),
                    jsonb_array_elements_text(doc.g -> 'w'),
                    jsonb_array_elements_text(doc.g -> 'uk'),
                    jsonb_array_elements_text(doc.g -> 'name'),
                    jsonb_array_elements_text(doc.g -> 'anyway'),
                    jsonb_array_elements_text(doc.g -> 'up'),
                    jsonb_array_elements_text(doc.g -> 'down'),
                    jsonb_array_elements_text(doc.g -> 'tg'))
         WITH ORDINALITY AS u(q, t, a, p, r, d, m, ok, kl, kr, kp, w, uk, name, anyway, up, down,
                              tg, n)
)"""


def _jobs_of_given(workflow_id: str, meta: str = "NULL") -> str:
    """The given steps' jobs, in step order, and their ids in that order (``ids``). A
    step's tags (tg, a JSON array) join its meta."""
    meta = (
        f"CASE WHEN u.tg IS NULL THEN {meta} ELSE coalesce({meta}, jsonb_build_object()) "
        "|| jsonb_build_object('tags', u.tg::jsonb) END"
    )
    return f"""
inserted AS (
    INSERT INTO {{jobs}} (queue, task, args, priority, run_at, state, max_attempts,
                        ordering_key, key_limit, key_rate, key_period, workflow_id, meta,
                        unique_key)
    SELECT u.q, u.t, u.a::jsonb, u.p::smallint, l.due,
           CASE WHEN u.w::int > 0 THEN 'waiting'
                WHEN u.ok IS NOT NULL THEN 'blocked'
                WHEN l.due > now() THEN 'scheduled' ELSE 'available' END,
           u.m::int, u.ok, u.kl::smallint, u.kr::int, u.kp::float8, {workflow_id}, {meta},
           u.uk
    FROM given AS u,
         LATERAL (SELECT COALESCE(u.r::timestamptz,
                                  now() + u.d::float8 * interval '1 second') AS due) AS l
    ORDER BY u.n
    RETURNING id
), ids AS (
    SELECT array_agg(id ORDER BY id) AS ids FROM inserted
)"""


# With tracing on, each step's meta: the send span's context (tracing.Send.meta_json) and
# the workflow's id, for the process span's attribute. NULL otherwise, as for any job.
_TRACED = "%(meta)s::jsonb || jsonb_build_object('workflow', (SELECT id FROM workflow))"

WORKFLOW_INSERT = f"""
WITH workflow AS (
    INSERT INTO {{workflows}} (name, options, steps, steps_left)
    VALUES (%(name)s, %(options)s::jsonb, %(steps)s, %(steps)s)
    RETURNING id
), {_GIVEN}, {_jobs_of_given("(SELECT id FROM workflow)", _TRACED)}, steps AS (
    INSERT INTO {{workflow_steps}} (job_id, workflow_id, step, name, parents, children,
                                  pending, run_anyway, key_limit, key_rate, key_period)
    SELECT ids.ids[u.n], (SELECT id FROM workflow), u.n, u.name, u.up::int[], u.down::int[],
           u.w::int, u.anyway::boolean, u.kl::smallint, u.kr::int, u.kp::float8
    FROM ids, given AS u
    RETURNING job_id
)
SELECT (SELECT id FROM workflow), (SELECT ids FROM ids), (SELECT count(*) FROM steps)
"""

# Jobs added to an open batch (migration 0024, decision 025): batch_reserve first (it
# locks the callback's row, counts the jobs in and numbers their steps; it raises for a
# batch closed or unknown), then the jobs and their steps, each a parent of the callback
# (step 1), named after its task and its number. The jobs' insert reads the reserved
# number, so the reservation runs before any job is written.
BATCH_ADD = f"""
WITH reserved AS MATERIALIZED (
    SELECT {{schema}}.batch_reserve(%(batch)s, %(steps)s) AS first
), {_GIVEN}, {_jobs_of_given("(SELECT %(batch)s::bigint FROM reserved)")}, steps AS (
    INSERT INTO {{workflow_steps}} (job_id, workflow_id, step, name, parents, children,
                                  pending, run_anyway, key_limit, key_rate, key_period)
    SELECT ids.ids[u.n], %(batch)s, r.first + u.n - 1,
           left(u.t, 240) || '#' || (r.first + u.n - 1), ARRAY[]::integer[], ARRAY[1], 0, false,
           u.kl::smallint, u.kr::int, u.kp::float8
    FROM ids, given AS u, reserved AS r
    RETURNING job_id
)
SELECT (SELECT ids FROM ids), (SELECT count(*) FROM steps)
"""

# Steps added by a running step (migration 0025): workflow_steps_reserve has counted them
# in and numbered them (%(numbers)s, in the order given); here their jobs, waiting for the
# adder, and their rows: the adder their parent, the adder's children but those it added
# theirs.
STEPS_RESERVE = """
SELECT step_name, step_number, existing
FROM {schema}.workflow_steps_reserve(%(adder)s, %(attempt)s, %(names)s::text[])
"""

STEPS_ADD = f"""
WITH adder AS MATERIALIZED (
    SELECT s.workflow_id, s.step,
           ARRAY(SELECT c.step
                 FROM unnest(s.children) AS n(step)
                 JOIN {{workflow_steps}} AS c
                     ON c.workflow_id = s.workflow_id AND c.step = n.step
                 WHERE c.added_by IS DISTINCT FROM s.job_id
                 ORDER BY c.step) AS after_it
    FROM {{workflow_steps}} AS s
    WHERE s.job_id = %(adder)s
), {_GIVEN}, {_jobs_of_given("(SELECT workflow_id FROM adder)")}, steps AS (
    INSERT INTO {{workflow_steps}} (job_id, workflow_id, step, name, parents, children,
                                  pending, run_anyway, key_limit, key_rate, key_period,
                                  added_by)
    SELECT ids.ids[u.n], a.workflow_id, (%(numbers)s::integer[])[u.n], u.name, ARRAY[a.step],
           a.after_it, 1, u.anyway::boolean, u.kl::smallint, u.kr::int, u.kp::float8,
           %(adder)s
    FROM ids, given AS u, adder AS a
    RETURNING job_id
)
SELECT (SELECT ids FROM ids), (SELECT count(*) FROM steps)
"""

BATCH_CLOSE = "SELECT {schema}.batch_close(%(batch)s)"

# Inside a batch's callback: how its jobs ended (step 1 is the callback itself).
BATCH_COUNTS = """
SELECT s.outcome, count(*)
FROM {workflow_steps} AS c
JOIN {workflow_steps} AS s ON s.workflow_id = c.workflow_id AND s.step > 1
WHERE c.job_id = %(id)s AND c.step = 1
GROUP BY s.outcome
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
JOIN {workflow_steps} AS p ON p.workflow_id = s.workflow_id AND p.step = ANY(s.parents)
LEFT JOIN LATERAL (SELECT x.state, x.result, x.errors FROM {history} AS x
                   WHERE x.id = p.job_id LIMIT 1) AS h ON true
LEFT JOIN {jobs} AS j ON j.id = p.job_id
WHERE s.job_id = %(id)s
ORDER BY p.name
"""

# `jobs show`: the workflow a job is a step of, and its parents' and children's names.
STEP_OF_JOB = """
SELECT w.id AS workflow_id, w.name AS workflow_name, w.state AS workflow_state,
       w.options ->> 'batch' = 'true' AS batch, s.name, s.step, w.steps, s.pending,
       ARRAY(SELECT p.name FROM unnest(s.parents) AS n(step)
             JOIN {workflow_steps} AS p ON p.workflow_id = s.workflow_id AND p.step = n.step
             ORDER BY p.step) AS parents,
       ARRAY(SELECT c.name FROM unnest(s.children) AS n(step)
             JOIN {workflow_steps} AS c ON c.workflow_id = s.workflow_id AND c.step = n.step
             ORDER BY c.step) AS children
FROM {workflow_steps} AS s
JOIN {workflows} AS w ON w.id = s.workflow_id
WHERE s.job_id = %(id)s
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
SELECT s.job_id, s.step, s.name, s.parents, s.pending, s.run_anyway, s.outcome,
       coalesce(j.state, h.state) AS state, coalesce(j.task, h.task) AS task,
       coalesce(j.attempts, h.attempts) AS attempts, h.finished_at
FROM {workflow_steps} AS s
LEFT JOIN {jobs} AS j ON j.id = s.job_id
LEFT JOIN LATERAL (SELECT x.state, x.task, x.attempts, x.finished_at FROM {history} AS x
                   WHERE x.id = s.job_id LIMIT 1) AS h ON j.id IS NULL
WHERE s.workflow_id = %(id)s
ORDER BY s.step
"""

# Cancelling a workflow: its live steps are cancelled as `jobs cancel` cancels jobs
# (client.cancel_jobs: the running ones asked to stop, the waiting ones to history, whose
# DELETE's trigger counts them as ended), then it is marked cancelled, so that the steps
# that end after it leave it so. Marked last, in the order a step's completion locks the
# rows (its job, its step, then the workflow): marked first, the cancel held the
# workflow's row while it waited for a completing step's job, and that completion waited
# for the workflow's row, a deadlock PostgreSQL broke by failing one of them. Cancelling
# the last live steps may have ended it failed already, in this transaction (finished
# now()); a workflow that ended by another's commit is left as it ended. A workflow's
# live steps are found by a scan of the live jobs: the hot table is small, and an index
# of workflow_id would be written by every step's moves.
WORKFLOW_CANCEL = """
UPDATE {workflows}
SET state = 'cancelled', finished_at = coalesce(finished_at, now())
WHERE id = %(id)s AND (state = 'running' OR (state = 'failed' AND finished_at = now()))
RETURNING id
"""

WORKFLOW_LIVE_STEPS = """
SELECT id FROM {jobs} WHERE workflow_id = %(id)s ORDER BY id
"""
