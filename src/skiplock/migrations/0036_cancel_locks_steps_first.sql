-- skiplock 0036: a cancel or delete by hand of waiting steps locks their step rows before
-- their jobs. A parent's completion counts a child under the child's step row, then
-- releases it with an UPDATE of its job; a DELETE of the waiting child took its job's row
-- first and its step's row after (in the trigger that ends it), and the two could wait
-- for each other, a deadlock PostgreSQL broke by failing one. Running steps are left out:
-- their completions take their job's row first, and a cancel only asks them to stop.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

CREATE FUNCTION workflow_steps_lock(ids bigint[]) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM FROM workflow_steps AS s
    WHERE s.job_id = ANY(ids) AND s.outcome IS NULL
      AND EXISTS (SELECT FROM jobs AS j WHERE j.id = s.job_id AND j.state <> 'running')
    ORDER BY s.job_id
    FOR UPDATE OF s;
END
$$;

REVOKE EXECUTE ON FUNCTION workflow_steps_lock(bigint[]) FROM PUBLIC;
