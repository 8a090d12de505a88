-- skiplock 0025: steps added to a workflow by one of its running steps (a crawler's pages,
-- found as it runs; decision 024). The new steps run after the step that adds them, and
-- the steps that ran after it now wait for them too. They are idempotent by name: a re-run
-- of the adder (after a crash, a retry) that adds the same names adds nothing, and gets
-- the steps added the first time.
--
-- workflow_steps_reserve checks and counts them in, with the owner's rights (the worker
-- role may not update the workflow tables); the same transaction then inserts their jobs
-- and step rows (sql/workflows.py). Locks are taken in the order every statement that
-- ends steps takes them: the adder's step row, its children's rows in id order, then the
-- workflow's row, which also serializes two adders of one workflow while names are
-- checked.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- The step that added this one (NULL: enqueued with its workflow). An adder's own
-- additions are among its children; only its other children wait for what it adds next.
-- Nullable without a default: adding it rewrites nothing.
ALTER TABLE workflow_steps ADD COLUMN added_by bigint;

-- For running attempt ``attempt`` (lease mode's fencing token) of step ``adder``, room for
-- the steps ``names`` not in its workflow yet: each name with its step number, and the
-- job id of a step of that name that exists already (NULL for the new ones, which the
-- caller inserts). Raises, writing nothing, when the attempt is no longer the live one
-- or the workflow has ended.
CREATE FUNCTION workflow_steps_reserve(adder bigint, attempt integer, names text[])
RETURNS TABLE (step_name text, step_number integer, existing bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    owner bigint;
    own_children integer[];
    fresh text[];
    numbers integer[];
    first_step integer;
BEGIN
    SELECT s.workflow_id, s.children INTO owner, own_children
    FROM workflow_steps AS s
    WHERE s.job_id = adder AND s.outcome IS NULL
    FOR UPDATE;
    IF owner IS NULL THEN
        RAISE EXCEPTION 'job % is not a live workflow step: only a running step adds steps '
            'to its workflow', adder USING ERRCODE = '55000';
    END IF;
    IF NOT EXISTS (SELECT FROM jobs AS j
                   WHERE j.id = adder AND j.state = 'running' AND j.attempts = attempt) THEN
        RAISE EXCEPTION 'job % is no longer running as attempt % (its lease was lost, or it '
            'ended): the steps it adds are refused', adder, attempt USING ERRCODE = '55000';
    END IF;
    -- Children joined on their numbers: one index lookup each (0027).
    PERFORM 1 FROM unnest(own_children) AS n(step)
    JOIN workflow_steps AS c ON c.workflow_id = owner AND c.step = n.step
    WHERE c.outcome IS NULL
    ORDER BY c.job_id FOR UPDATE OF c;
    PERFORM 1 FROM workflows WHERE id = owner FOR UPDATE;

    fresh := ARRAY(SELECT n FROM unnest(names) WITH ORDINALITY AS u(n, i)
                   WHERE NOT EXISTS (SELECT FROM workflow_steps AS k
                                     WHERE k.workflow_id = owner AND k.name = u.n)
                   GROUP BY n ORDER BY min(i));
    IF cardinality(fresh) > 0 THEN
        UPDATE workflows
        SET steps = steps + cardinality(fresh), steps_left = steps_left + cardinality(fresh)
        WHERE id = owner AND state = 'running'
        RETURNING steps - cardinality(fresh) + 1 INTO first_step;
        IF first_step IS NULL THEN
            RAISE EXCEPTION 'workflow % has ended: no step can be added to it', owner
                USING ERRCODE = '55000';
        END IF;
        numbers := ARRAY(SELECT first_step + i - 1 FROM generate_series(1, cardinality(fresh)) AS i);
        -- What ran after the adder runs after the new steps too.
        UPDATE workflow_steps AS c
        SET pending = c.pending + cardinality(fresh), parents = c.parents || numbers
        FROM unnest(own_children) AS n(step)
        WHERE c.workflow_id = owner AND c.step = n.step AND c.outcome IS NULL
          AND c.added_by IS DISTINCT FROM adder;
        UPDATE workflow_steps SET children = children || numbers WHERE job_id = adder;
    END IF;
    RETURN QUERY
        SELECT f.n, first_step + f.i::integer - 1, NULL::bigint
        FROM unnest(fresh) WITH ORDINALITY AS f(n, i)
        UNION ALL
        SELECT k.name, k.step, k.job_id
        FROM workflow_steps AS k
        WHERE k.workflow_id = owner AND k.name = ANY(names) AND NOT k.name = ANY(fresh);
END
$$;

-- Only workers run steps (skiplock/grants.py).
REVOKE EXECUTE ON FUNCTION workflow_steps_reserve(bigint, integer, text[]) FROM PUBLIC;
