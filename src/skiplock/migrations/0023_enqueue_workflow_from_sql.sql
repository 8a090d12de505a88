-- skiplock 0023: enqueue_workflow(jsonb), a workflow started from SQL: a trigger on the
-- application's own table, psql, a service in another language. It writes the rows the
-- Python enqueue writes (decision 024), in the caller's transaction, and checks its
-- argument first: one clear error naming the step, and nothing written.
--
-- The argument: {"name": ..., "run_anyway": false, "steps": [{"task": ..., "name": ...,
-- "args": {...}, "after": [names], "queue": ..., "priority": ..., "run_at": ...,
-- "max_attempts": ..., "run_anyway": ...}, ...]}. Only "task" is required; a step's name
-- defaults to its task. Each step lists its parents by name among the steps before it,
-- so a cycle cannot be written. Keyed and unique steps are the Python API's.
--
-- SECURITY INVOKER, so EXECUTE stays with PUBLIC: the caller needs the enqueue role's
-- privileges on jobs and the workflow tables anyway (skiplock/grants.py).
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

CREATE FUNCTION enqueue_workflow(workflow jsonb) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    steps jsonb := workflow -> 'steps';
    count_of integer;
    step jsonb;
    n integer := 0;
    label text;
    problem text;
    anyway boolean;
    made bigint;
BEGIN
    IF jsonb_typeof(workflow) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'enqueue_workflow takes a JSON object {"steps": [...]}, got %',
            coalesce(jsonb_typeof(workflow), 'NULL') USING ERRCODE = '22023';
    END IF;
    SELECT string_agg(key, ', ' ORDER BY key) INTO problem
    FROM jsonb_object_keys(workflow) AS key
    WHERE key NOT IN ('name', 'run_anyway', 'steps');
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'enqueue_workflow: unknown field %; a workflow has name, run_anyway '
            'and steps', problem USING ERRCODE = '22023';
    END IF;
    IF workflow ? 'name' AND jsonb_typeof(workflow -> 'name') <> 'null'
       AND (jsonb_typeof(workflow -> 'name') <> 'string'
            OR char_length(workflow ->> 'name') NOT BETWEEN 1 AND 255) THEN
        RAISE EXCEPTION 'enqueue_workflow: the workflow''s name must be a string of 1 to 255 '
            'characters, got %', workflow -> 'name' USING ERRCODE = '22023';
    END IF;
    IF workflow ? 'run_anyway' AND jsonb_typeof(workflow -> 'run_anyway') <> 'boolean' THEN
        RAISE EXCEPTION 'enqueue_workflow: run_anyway must be true or false, got %',
            workflow -> 'run_anyway' USING ERRCODE = '22023';
    END IF;
    anyway := coalesce((workflow ->> 'run_anyway')::boolean, false);
    IF jsonb_typeof(steps) IS DISTINCT FROM 'array' OR jsonb_array_length(steps) = 0 THEN
        RAISE EXCEPTION 'enqueue_workflow: "steps" must be a non-empty array of steps '
            '({"task": ...}), got %', coalesce(steps::text, 'nothing') USING ERRCODE = '22023';
    END IF;
    count_of := jsonb_array_length(steps);
    IF count_of > 100000 THEN  -- skiplock.workflow.MAX_STEPS
        RAISE EXCEPTION 'enqueue_workflow: a workflow holds at most 100,000 steps, got %; '
            'split it into several', count_of USING ERRCODE = '22023';
    END IF;

    FOR step IN SELECT value FROM jsonb_array_elements(steps) LOOP
        n := n + 1;
        label := format('step %s', n);
        IF jsonb_typeof(step) <> 'object' THEN
            RAISE EXCEPTION 'enqueue_workflow: % must be an object {"task": ...}, got %',
                label, step USING ERRCODE = '22023';
        END IF;
        IF jsonb_typeof(step -> 'name') = 'string' THEN
            label := format('step %s (%s)', n, step ->> 'name');
        END IF;
        SELECT string_agg(key, ', ' ORDER BY key) INTO problem
        FROM jsonb_object_keys(step) AS key
        WHERE key NOT IN ('task', 'name', 'args', 'after', 'queue', 'priority', 'run_at',
                          'max_attempts', 'run_anyway');
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION 'enqueue_workflow: % has unknown field %; a step has task, name, '
                'args, after, queue, priority, run_at, max_attempts and run_anyway',
                label, problem USING ERRCODE = '22023';
        END IF;
        problem := CASE
            WHEN jsonb_typeof(step -> 'task') IS DISTINCT FROM 'string'
                 OR char_length(step ->> 'task') NOT BETWEEN 1 AND 255
                THEN format('"task" must be a task name of 1 to 255 characters, got %s',
                            coalesce((step -> 'task')::text, 'nothing'))
            WHEN step ? 'name' AND (jsonb_typeof(step -> 'name') <> 'string'
                                    OR char_length(step ->> 'name') NOT BETWEEN 1 AND 255)
                THEN format('"name" must be a string of 1 to 255 characters, got %s',
                            step -> 'name')
            WHEN step ? 'args' AND jsonb_typeof(step -> 'args') <> 'object'
                THEN format('"args" must be an object of keyword arguments, got %s',
                            step -> 'args')
            WHEN step ? 'after' AND (jsonb_typeof(step -> 'after') <> 'array'
                 OR EXISTS (SELECT FROM jsonb_array_elements(step -> 'after') AS p
                            WHERE jsonb_typeof(p) <> 'string'))
                THEN format('"after" must be an array of step names, got %s', step -> 'after')
            WHEN step ? 'queue' AND (jsonb_typeof(step -> 'queue') <> 'string'
                                     OR char_length(step ->> 'queue') NOT BETWEEN 1 AND 128)
                THEN format('"queue" must be a queue name of 1 to 128 characters, got %s',
                            step -> 'queue')
            WHEN step ? 'priority' AND NOT CASE jsonb_typeof(step -> 'priority')
                 WHEN 'number' THEN (step ->> 'priority')::numeric BETWEEN -32768 AND 32767
                                    AND (step ->> 'priority')::numeric % 1 = 0
                 ELSE false END
                THEN format('"priority" must be an integer from -32768 to 32767, got %s',
                            step -> 'priority')
            WHEN step ? 'max_attempts' AND NOT CASE jsonb_typeof(step -> 'max_attempts')
                 WHEN 'number' THEN (step ->> 'max_attempts')::numeric BETWEEN 1 AND 2147483647
                                    AND (step ->> 'max_attempts')::numeric % 1 = 0
                 ELSE false END
                THEN format('"max_attempts" must be an integer from 1 to 2147483647, got %s',
                            step -> 'max_attempts')
            WHEN step ? 'run_anyway' AND jsonb_typeof(step -> 'run_anyway') <> 'boolean'
                THEN format('"run_anyway" must be true or false, got %s', step -> 'run_anyway')
            WHEN step ? 'run_at' AND jsonb_typeof(step -> 'run_at') <> 'string'
                THEN format('"run_at" must be a timestamp string, got %s', step -> 'run_at')
        END;
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION 'enqueue_workflow: %: %', label, problem USING ERRCODE = '22023';
        END IF;
        IF step ? 'run_at' THEN
            BEGIN
                PERFORM (step ->> 'run_at')::timestamptz;
            EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow THEN
                RAISE EXCEPTION 'enqueue_workflow: %: "run_at" must be a timestamp '
                    '(2026-12-03T10:00:00Z), got %', label, step -> 'run_at'
                    USING ERRCODE = '22023';
            END;
        END IF;
    END LOOP;

    SELECT format('two steps are named %s; step names are unique (give each a "name")',
                  quote_literal(named))
    INTO problem
    FROM (SELECT coalesce(s ->> 'name', s ->> 'task') AS named
          FROM jsonb_array_elements(steps) AS s) AS names
    GROUP BY named HAVING count(*) > 1
    LIMIT 1;
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'enqueue_workflow: %', problem USING ERRCODE = '22023';
    END IF;

    WITH s AS (
        SELECT e.n, coalesce(e.s ->> 'name', e.s ->> 'task') AS named, e.s
        FROM jsonb_array_elements(steps) WITH ORDINALITY AS e(s, n)
    )
    SELECT format('step %s (%s) runs after %s, ', c.n, c.named, quote_literal(a.parent))
           || CASE WHEN p.n IS NULL THEN 'which is not a step of this workflow'
                   WHEN p.n = c.n THEN 'itself'
                   ELSE 'which is listed after it: list each step after its parents '
                        '(so that no cycle can be written)' END
    INTO problem
    FROM s AS c
    CROSS JOIN jsonb_array_elements_text(coalesce(c.s -> 'after', '[]'::jsonb)) AS a(parent)
    LEFT JOIN s AS p ON p.named = a.parent
    WHERE p.n IS NULL OR p.n >= c.n
    ORDER BY c.n
    LIMIT 1;
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'enqueue_workflow: %', problem USING ERRCODE = '22023';
    END IF;

    -- The rows Python's WORKFLOW_INSERT writes: the jobs in step order (their ids, in
    -- order, are the steps'), each step's parents and children by number.
    WITH s AS MATERIALIZED (
        SELECT e.n::integer AS n, coalesce(e.s ->> 'name', e.s ->> 'task') AS named, e.s,
               coalesce((e.s ->> 'run_at')::timestamptz, now()) AS due
        FROM jsonb_array_elements(steps) WITH ORDINALITY AS e(s, n)
    ), edges AS (
        SELECT DISTINCT c.n AS child, p.n AS parent
        FROM s AS c
        CROSS JOIN jsonb_array_elements_text(coalesce(c.s -> 'after', '[]'::jsonb)) AS a(parent)
        JOIN s AS p ON p.named = a.parent
    ), up AS (
        SELECT child, array_agg(parent ORDER BY parent) AS ups FROM edges GROUP BY child
    ), down AS (
        SELECT parent, array_agg(child ORDER BY child) AS downs FROM edges GROUP BY parent
    ), made_workflow AS (
        INSERT INTO workflows (name, options, steps, steps_left)
        VALUES (workflow ->> 'name', jsonb_build_object('run_anyway', anyway), count_of, count_of)
        RETURNING id
    ), inserted AS (
        INSERT INTO jobs (queue, task, args, priority, run_at, state, max_attempts, workflow_id)
        SELECT coalesce(s.s ->> 'queue', 'default'), s.s ->> 'task',
               coalesce(s.s -> 'args', '{}'::jsonb),
               coalesce((s.s ->> 'priority')::smallint, 0), s.due,
               CASE WHEN up.ups IS NOT NULL THEN 'waiting'
                    WHEN s.due > now() THEN 'scheduled' ELSE 'available' END,
               coalesce((s.s ->> 'max_attempts')::integer, 3), (SELECT id FROM made_workflow)
        FROM s LEFT JOIN up ON up.child = s.n
        ORDER BY s.n
        RETURNING id
    ), ids AS (
        SELECT array_agg(id ORDER BY id) AS ids FROM inserted
    ), written AS (
        INSERT INTO workflow_steps (job_id, workflow_id, step, name, parents, children,
                                    pending, run_anyway)
        SELECT ids.ids[s.n], (SELECT id FROM made_workflow), s.n, s.named,
               coalesce(up.ups, '{}'), coalesce(down.downs, '{}'),
               coalesce(cardinality(up.ups), 0),
               coalesce((s.s ->> 'run_anyway')::boolean, anyway)
        FROM ids, s
        LEFT JOIN up ON up.child = s.n
        LEFT JOIN down ON down.parent = s.n
        RETURNING job_id
    )
    SELECT (SELECT id FROM made_workflow) INTO made
    FROM (SELECT count(*) FROM written) AS all_written;
    RETURN made;
END
$$;
