-- skiplock 0035: a step's end reads its outcome from today's history partitions only.
-- The row trigger of 0022 found each ended step's history row by id across every
-- partition of job_history, past days first: at the default retention a week of them,
-- one index probe each per step, before the partition the row was written to. That row
-- was written by the statement whose DELETE fired the trigger, with finished_at = now();
-- the lookup now says so, and partitions that end before now() are pruned when it starts.
-- A job deleted by hand has no history row and still ends its step as cancelled.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

CREATE OR REPLACE FUNCTION workflow_steps_left() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM gone WHERE workflow_id IS NOT NULL) THEN
        RETURN NULL;
    END IF;
    PERFORM workflow_steps_end(array_agg(g.id), array_agg(coalesce(h.state, 'cancelled')))
    FROM gone AS g
    LEFT JOIN LATERAL (SELECT x.state FROM job_history AS x
                       WHERE x.id = g.id AND x.finished_at >= now()
                       LIMIT 1) AS h ON true
    WHERE g.workflow_id IS NOT NULL
    HAVING count(*) > 0;
    RETURN NULL;
END
$$;
