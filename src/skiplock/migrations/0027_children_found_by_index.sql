-- skiplock 0027: a step's children found by index whatever the statistics say. The
-- functions of 0022 looked a parent's children up as `step = ANY(children)` beside the
-- workflow's id; on a workflow written a moment ago (no ANALYZE yet) the planner took the
-- index for the id alone and filtered every step of the workflow, per parent: a fan-in of
-- 10,000 parents read 10,000 rows for each, and drained at 3% of plain jobs (skiplock
-- bench --scenarios workflow). Now each child is a lateral subquery on both columns (its
-- LIMIT keeps the planner from turning it back into a join), one probe of the
-- (workflow_id, step) index, and the functions plan without sequential scans, hash or
-- merge joins: every row they touch is found by key, and a table without statistics yet
-- must not talk the planner into reading it whole. Otherwise they are 0022's.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- Room on each page for every step row to be written once more (its outcome) as a HOT
-- update, without new index entries: at 80% most steps' ends moved their row to another
-- page and indexed it again. Measured, 100 workflows of 100 steps drained by one worker:
-- 1.26 s at 80%, 1.05 s at 50%. New pages only; SHARE UPDATE EXCLUSIVE blocks no write.
ALTER TABLE workflow_steps SET (fillfactor = 50);

CREATE OR REPLACE FUNCTION workflow_steps_end(ended bigint[], outcomes text[]) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    marked bigint[];
    failed bigint[];
    doomed bigint[];
    released bigint[];
    released_queues bigint;
BEGIN
    -- The steps ending now, their rows locked in id order.
    PERFORM 1 FROM workflow_steps
    WHERE job_id = ANY(ended) AND outcome IS NULL
    ORDER BY job_id FOR UPDATE;
    WITH newly AS (
        UPDATE workflow_steps AS s SET outcome = e.outcome
        FROM unnest(ended, outcomes) AS e(id, outcome)
        WHERE s.job_id = e.id AND s.outcome IS NULL
        RETURNING s.job_id, s.outcome
    )
    SELECT coalesce(array_agg(job_id), '{}'),
           coalesce(array_agg(job_id) FILTER (WHERE outcome <> 'completed'), '{}')
    INTO marked, failed
    FROM newly;
    IF cardinality(marked) = 0 THEN
        RETURN;
    END IF;

    -- A failed step cancels every step that depends on it, transitively, except those
    -- that run anyway (and what only depends on them). They are all waiting: a step whose
    -- parent did not complete was never released.
    IF cardinality(failed) > 0 THEN
        WITH RECURSIVE doomed_steps (id, cause) AS (
            -- Seeded with the failed steps themselves: ended already, the UPDATE below
            -- passes them over.
            SELECT f.id, f.id FROM unnest(failed) AS f(id)
            UNION
            SELECT c.job_id, d.cause
            FROM doomed_steps AS d
            JOIN workflow_steps AS p ON p.job_id = d.id
            CROSS JOIN LATERAL unnest(p.children) AS n(step)
            CROSS JOIN LATERAL (SELECT k.* FROM workflow_steps AS k
                                WHERE k.workflow_id = p.workflow_id AND k.step = n.step
                                LIMIT 1) AS c
            WHERE NOT c.run_anyway AND c.outcome IS NULL
        ), marked_doomed AS (
            UPDATE workflow_steps AS s
            SET outcome = 'cancelled', cancelled_by = d.cause
            FROM (SELECT id, min(cause) AS cause FROM doomed_steps GROUP BY id) AS d
            WHERE s.job_id = d.id AND s.outcome IS NULL
            RETURNING s.job_id
        )
        SELECT coalesce(array_agg(job_id ORDER BY job_id), '{}') INTO doomed FROM marked_doomed;
        IF cardinality(doomed) > 0 THEN
            -- Into history as cancelled, saying why. This DELETE fires the trigger below
            -- again, for steps already marked ended: it finds nothing to do.
            WITH gone AS (
                DELETE FROM jobs AS j
                WHERE j.id = ANY(doomed) AND j.state = 'waiting'
                RETURNING j.*
            )
            INSERT INTO job_history (id, queue, task, args, state, priority, attempts,
                                     max_attempts, errors, result, unique_key, ordering_key,
                                     created_at, attempted_at, progress, started_at,
                                     worker_ids, meta)
            SELECT g.id, g.queue, g.task, g.args, 'cancelled', g.priority, g.attempts,
                   g.max_attempts,
                   g.errors || jsonb_build_array(jsonb_build_object(
                       'attempt', g.attempts, 'at', now(), 'type', 'ParentFailed',
                       'message', format('step %s of its workflow ended without completing',
                                         s.cancelled_by),
                       'traceback', NULL)),
                   NULL, g.unique_key, g.ordering_key, g.created_at, g.attempted_at,
                   g.progress, g.started_at, g.worker_ids, g.meta
            FROM gone AS g JOIN workflow_steps AS s ON s.job_id = g.id;
        END IF;
    END IF;

    -- The children of every step that ended here, locked in id order, then each
    -- decremented once by the parents that count for it. Each statement of this function
    -- takes its own snapshot: the decrement reads what the child's previous decrementer
    -- committed before the lock was granted.
    PERFORM 1 FROM workflow_steps AS c
    WHERE (c.workflow_id, c.step) IN (SELECT p.workflow_id, unnest(p.children)
                                      FROM workflow_steps AS p
                                      WHERE p.job_id = ANY(marked || doomed))
      AND c.outcome IS NULL
    ORDER BY c.job_id FOR UPDATE;
    WITH edges AS (
        SELECT ch.id AS child,
               count(*) AS parents,
               count(*) FILTER (WHERE p.outcome = 'completed') AS completed
        FROM workflow_steps AS p CROSS JOIN LATERAL unnest(p.children) AS n(step)
            CROSS JOIN LATERAL (SELECT k.job_id AS id FROM workflow_steps AS k
                                WHERE k.workflow_id = p.workflow_id AND k.step = n.step
                                LIMIT 1) AS ch
        WHERE p.job_id = ANY(marked || doomed)
        GROUP BY ch.id
    ), counted AS (
        UPDATE workflow_steps AS c
        SET pending = c.pending - CASE WHEN c.run_anyway THEN e.parents ELSE e.completed END
        FROM edges AS e
        WHERE c.job_id = e.child AND c.outcome IS NULL AND (c.run_anyway OR e.completed > 0)
        RETURNING c.job_id, c.pending
    )
    SELECT coalesce(array_agg(job_id), '{}') INTO released FROM counted WHERE pending = 0;

    IF cardinality(released) > 0 THEN
        -- Released as an enqueue would have written them: a keyed step joins its key's
        -- line (the row trigger jobs_key_moved asks the leader to admit it), a delayed one
        -- waits for its time. Claim cursors that moved past a released step's place are
        -- told to rewind, as admission does (0015).
        WITH moved AS (
            UPDATE jobs AS j
            SET state = CASE WHEN j.ordering_key IS NOT NULL THEN 'blocked'
                             WHEN j.run_at > now() THEN 'scheduled'
                             ELSE 'available' END
            WHERE j.id = ANY(released) AND j.state = 'waiting'
            RETURNING j.queue, j.priority, j.run_at, j.state
        )
        SELECT count(*) INTO released_queues
        FROM (SELECT pg_notify(current_schema() || '.jobs',
                               moved.queue || E'\t' || min(moved.priority) || E'\t'
                               || extract(epoch FROM min(moved.run_at)))
              FROM moved
              WHERE moved.state = 'available'
              GROUP BY moved.queue) AS notified;
    END IF;

    -- The workflows: their last step ended here, or not yet. Locked in id order.
    PERFORM 1 FROM workflows
    WHERE id IN (SELECT workflow_id FROM workflow_steps WHERE job_id = ANY(marked || doomed))
    ORDER BY id FOR UPDATE;
    UPDATE workflows AS w
    SET steps_left = w.steps_left - n.steps,
        steps_failed = w.steps_failed + n.failed,
        state = CASE WHEN w.state <> 'running' OR w.steps_left > n.steps THEN w.state
                     WHEN w.steps_failed + n.failed > 0 THEN 'failed'
                     ELSE 'completed' END,
        finished_at = CASE WHEN w.steps_left = n.steps THEN coalesce(w.finished_at, now())
                           ELSE w.finished_at END
    FROM (SELECT workflow_id, count(*) AS steps,
                 count(*) FILTER (WHERE outcome <> 'completed') AS failed
          FROM workflow_steps WHERE job_id = ANY(marked || doomed)
          GROUP BY workflow_id) AS n
    WHERE w.id = n.workflow_id;
END
$$;

CREATE OR REPLACE FUNCTION workflow_step_retried(retried bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    frontier bigint[] := ARRAY[retried];
    revived bigint[] := ARRAY[retried];
    batch bigint[];
    owner bigint;
BEGIN
    UPDATE workflow_steps SET outcome = NULL
    WHERE job_id = retried AND outcome = 'dead'
    RETURNING workflow_id INTO owner;
    IF owner IS NULL THEN
        RETURN;
    END IF;
    LOOP
        batch := ARRAY(
            SELECT DISTINCT c.job_id
            FROM workflow_steps AS p
            CROSS JOIN LATERAL unnest(p.children) AS n(step)
            CROSS JOIN LATERAL (SELECT k.job_id AS id FROM workflow_steps AS k
                                WHERE k.workflow_id = p.workflow_id AND k.step = n.step
                                LIMIT 1) AS ch
            JOIN workflow_steps AS c ON c.job_id = ch.id
            WHERE p.job_id = ANY(frontier)
              AND c.outcome = 'cancelled' AND c.cancelled_by IS NOT NULL
              AND NOT EXISTS (SELECT FROM workflow_steps AS q
                              WHERE q.workflow_id = c.workflow_id AND q.step = ANY(c.parents)
                                AND q.outcome IN ('dead', 'cancelled')));
        EXIT WHEN cardinality(batch) = 0;
        UPDATE workflow_steps AS c
        SET outcome = NULL, cancelled_by = NULL,
            pending = (SELECT count(*) FROM workflow_steps AS q
                       WHERE q.workflow_id = c.workflow_id AND q.step = ANY(c.parents)
                         AND q.outcome IS DISTINCT FROM 'completed')
        WHERE c.job_id = ANY(batch);
        WITH back AS (
            DELETE FROM job_history AS h
            WHERE h.id = ANY(batch) AND h.state = 'cancelled'
            RETURNING h.*
        )
        INSERT INTO jobs (id, queue, task, args, state, priority, max_attempts, errors,
                          unique_key, ordering_key, key_limit, key_rate, key_period,
                          created_at, meta, workflow_id)
        SELECT b.id, b.queue, b.task, b.args, 'waiting', b.priority, b.max_attempts,
               b.errors, b.unique_key, b.ordering_key, coalesce(s.key_limit, 1), s.key_rate,
               s.key_period, b.created_at, b.meta, s.workflow_id
        FROM back AS b JOIN workflow_steps AS s ON s.job_id = b.id;
        revived := revived || batch;
        frontier := batch;
    END LOOP;
    -- Steps that run anyway counted each revived parent when it ended; it will end again.
    UPDATE workflow_steps AS c
    SET pending = c.pending + e.parents
    FROM (SELECT ch.id AS child, count(*) AS parents
          FROM workflow_steps AS p
          CROSS JOIN LATERAL unnest(p.children) AS n(step)
            CROSS JOIN LATERAL (SELECT k.job_id AS id FROM workflow_steps AS k
                                WHERE k.workflow_id = p.workflow_id AND k.step = n.step
                                LIMIT 1) AS ch
          WHERE p.job_id = ANY(revived)
          GROUP BY ch.id) AS e
    WHERE c.job_id = e.child AND c.run_anyway AND c.outcome IS NULL
      AND EXISTS (SELECT FROM jobs AS j WHERE j.id = c.job_id AND j.state = 'waiting');
    UPDATE workflows
    SET steps_left = steps_left + cardinality(revived),
        steps_failed = greatest(steps_failed - cardinality(revived), 0),
        state = CASE WHEN state = 'cancelled' THEN state ELSE 'running' END,
        finished_at = CASE WHEN state = 'cancelled' THEN finished_at END
    WHERE id = owner;
END
$$;
