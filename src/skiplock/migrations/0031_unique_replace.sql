-- skiplock 0031: a unique enqueue whose key is held may replace instead of being refused
-- (decision 028). The holder takes the new values of the fields asked for (arguments, run
-- time, priority, attempts) while it still waits to start, never attempted: scheduled,
-- available, or blocked behind its key. A debounce is a replacement of the run time: each
-- enqueue pushes it back. A holder that a worker claimed, or that ran once, is left as
-- it is, and the enqueue returns it as a duplicate (or, in the 'queued' scope, a new job
-- is inserted once the holder started).

SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- Returns the holder's id when it took the values, NULL when no waiting holder has the key
-- (none at all, or one that started). The UPDATE locks the row: a claim that holds it
-- first makes it running, and the re-checked WHERE then leaves it alone. SECURITY
-- DEFINER: an enqueue-only role changes only these fields of waiting jobs with the key;
-- EXECUTE is granted by `skiplock grant` (every use).
CREATE FUNCTION job_replace_waiting(active_key text, queued_key text, fields text[],
                                    new_args jsonb, new_run_at timestamptz,
                                    new_priority smallint, new_max_attempts integer)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    holder bigint;
BEGIN
    IF fields IS NULL OR cardinality(fields) = 0
       OR NOT fields <@ ARRAY['args', 'run_at', 'priority', 'max_attempts'] THEN
        RAISE EXCEPTION 'job_replace_waiting: fields must name some of args, run_at, '
            'priority, max_attempts, got %', coalesce(fields::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF ('args' = ANY(fields) AND new_args IS NULL)
       OR ('run_at' = ANY(fields) AND new_run_at IS NULL)
       OR ('priority' = ANY(fields) AND new_priority IS NULL)
       OR ('max_attempts' = ANY(fields) AND new_max_attempts IS NULL) THEN
        RAISE EXCEPTION 'job_replace_waiting: a field to replace has no new value (%)',
            fields::text USING ERRCODE = '22023';
    END IF;
    UPDATE jobs AS j
    SET args = CASE WHEN 'args' = ANY(fields) THEN new_args ELSE j.args END,
        priority = CASE WHEN 'priority' = ANY(fields) THEN new_priority ELSE j.priority END,
        max_attempts = CASE WHEN 'max_attempts' = ANY(fields) THEN new_max_attempts
                            ELSE j.max_attempts END,
        run_at = CASE WHEN 'run_at' = ANY(fields) THEN new_run_at ELSE j.run_at END,
        -- A blocked job stays blocked: admission decides scheduled or available from its
        -- run_at when its key lets it in.
        state = CASE WHEN j.state = 'blocked' OR NOT 'run_at' = ANY(fields) THEN j.state
                     WHEN new_run_at > now() THEN 'scheduled'
                     ELSE 'available' END
    WHERE ((active_key IS NOT NULL AND j.unique_key = active_key AND j.state <> 'dead')
           OR (queued_key IS NOT NULL AND j.unique_queued_key = queued_key))
      AND j.state IN ('scheduled', 'available', 'blocked')
      AND j.attempts = 0
      AND j.retry_at IS NULL
    RETURNING j.id INTO holder;
    RETURN holder;
END
$$;
REVOKE EXECUTE ON FUNCTION
    job_replace_waiting(text, text, text[], jsonb, timestamptz, smallint, integer) FROM PUBLIC;
