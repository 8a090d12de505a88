-- skiplock 0026: finished workflows (and batches) leave with their history. A workflow's
-- rows are kept while it runs; once it has ended they are deleted, with its steps', when
-- history older than the same retention is (skiplock/history.py, by the leader and
-- `skiplock prune`), so that the workflow tables stay as small as the hot jobs table.
-- The worker's role may not delete from them: the function does it with the owner's
-- rights, for ended workflows only.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- The ended workflows by when they ended: the prune's scan. The table is new in 0022 and
-- small when this runs.
CREATE INDEX workflows_finished ON workflows (finished_at) WHERE finished_at IS NOT NULL;

-- Up to ``most`` workflows that ended before ``ended_before``, with their steps' rows;
-- how many. Rows another transaction holds (a late step's end) are left for the next pass.
CREATE FUNCTION workflows_prune(ended_before timestamptz, most integer) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    pruned integer;
BEGIN
    WITH gone AS (
        DELETE FROM workflows
        WHERE id IN (SELECT w.id FROM workflows AS w
                     WHERE w.finished_at < ended_before AND w.state <> 'running'
                     ORDER BY w.finished_at
                     LIMIT most
                     FOR UPDATE SKIP LOCKED)
        RETURNING id
    ), steps AS (
        DELETE FROM workflow_steps WHERE workflow_id IN (SELECT id FROM gone)
    )
    SELECT count(*) INTO pruned FROM gone;
    RETURN pruned;
END
$$;

REVOKE EXECUTE ON FUNCTION workflows_prune(timestamptz, integer) FROM PUBLIC;
