-- skiplock 0037: a step's end locks each row it changes by the UPDATE that changes it.
-- 0034's workflow_steps_end took the ending steps, their children and their workflows
-- with a locking CTE (SELECT ... ORDER BY id FOR UPDATE) and handed them to an UPDATE.
-- A row lock is a write of its own: the row's header, and a WAL record. The UPDATE
-- alone locks each row as it writes it, in the order its plan reads them: each UPDATE
-- now joins its target by primary key to a subquery sorted by that key (a sorted
-- subquery is not flattened), and the function plans nested loops only, which read
-- that subquery first (tests/workflows/test_costs.py reads the plans). So rows are still
-- locked in id order, and two enders never wait for each other in a cycle; a plan that
-- read them otherwise could only let them deadlock, which PostgreSQL breaks and the
-- completer retries. Exactly once as before: an UPDATE that meets a row another ender
-- changed since its snapshot waits for it, then re-checks the row's newest version
-- (READ COMMITTED) and computes from that one. Otherwise 0034's function.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

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
    -- The steps ending now, marked in id order: the UPDATE locks each row as it writes
    -- it, in the order of the sorted subquery it joins.
    WITH newly AS (
        UPDATE workflow_steps AS s SET outcome = l.outcome
        FROM (SELECT e.id AS job_id, e.outcome FROM unnest(ended, outcomes) AS e(id, outcome)
              ORDER BY e.id) AS l
        WHERE s.job_id = l.job_id AND s.outcome IS NULL
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
            FROM (SELECT id, min(cause) AS cause FROM doomed_steps GROUP BY id ORDER BY id)
                 AS d
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

    -- The children of every step that ended here, found once and sorted by id, then
    -- each decremented once, in that order, by the parents that count for it. A child
    -- another ender changed after this statement's snapshot is decremented from the
    -- value that ender committed: under READ COMMITTED the UPDATE re-reads a row
    -- changed since its snapshot (once the lock is granted) and computes the new value
    -- from that version.
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
        ORDER BY ch.id
    ), counted AS (
        UPDATE workflow_steps AS c
        SET pending = c.pending - CASE WHEN c.run_anyway THEN l.parents ELSE l.completed END
        FROM edges AS l
        WHERE c.job_id = l.child AND c.outcome IS NULL AND (c.run_anyway OR l.completed > 0)
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

    -- The workflows: their last step ended here, or not yet. Written in id order, as
    -- above, by the statement that counts them.
    WITH n AS (
        SELECT workflow_id, count(*) AS steps,
               count(*) FILTER (WHERE outcome <> 'completed') AS failed
        FROM workflow_steps WHERE job_id = ANY(marked || doomed)
        GROUP BY workflow_id
    ), sorted AS (
        SELECT n.workflow_id AS id, n.steps, n.failed FROM n ORDER BY n.workflow_id
    )
    UPDATE workflows AS w
    SET steps_left = w.steps_left - l.steps,
        steps_failed = w.steps_failed + l.failed,
        state = CASE WHEN w.state <> 'running' OR w.steps_left > l.steps THEN w.state
                     WHEN w.steps_failed + l.failed > 0 THEN 'failed'
                     ELSE 'completed' END,
        finished_at = CASE WHEN w.steps_left = l.steps THEN coalesce(w.finished_at, now())
                           ELSE w.finished_at END
    FROM sorted AS l
    WHERE w.id = l.id;
END
$$;

