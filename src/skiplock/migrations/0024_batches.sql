-- skiplock 0024: batches (decision 025). A batch is a workflow (0022) whose first step is
-- its callback: waiting, run anyway, its count of pending parents one more than the jobs
-- added so far, the one being the batch's closing. Jobs are added in any number of
-- transactions, each a step whose only child is the callback; the statement that ends
-- the last of them after the close, or the close after the last of them, releases the
-- callback, as the last parent of any step releases it. The workflow's options say it is
-- a batch and whether it is still open.
--
-- Adding and closing change the callback's count and the workflow's row, which the
-- enqueue role may not update: the two functions below do it, with the owner's rights,
-- for an open batch only. Each locks the callback's row before the workflow's, the
-- order in which the statements that end steps lock them (a step, its children, then
-- its workflow), so neither can deadlock with a completion. A transaction that adds to a
-- batch holds the callback's row until it ends: completions of that batch's jobs wait
-- for it meanwhile.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- Room for ``jobs`` more jobs in open batch ``batch``: the number of the first of their
-- steps (the callback is step 1).
CREATE FUNCTION batch_reserve(batch bigint, jobs integer) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    first_step integer;
BEGIN
    IF jobs IS NULL OR jobs < 1 THEN
        RAISE EXCEPTION 'a batch takes at least one job at a time, got %', jobs
            USING ERRCODE = '22023';
    END IF;
    PERFORM 1 FROM workflow_steps WHERE workflow_id = batch AND step = 1 FOR UPDATE;
    UPDATE workflows
    SET steps = steps + jobs, steps_left = steps_left + jobs
    WHERE id = batch AND options @> '{"batch": true, "open": true}' AND state = 'running'
    RETURNING steps - jobs + 1 INTO first_step;
    IF first_step IS NULL THEN
        PERFORM batch_refuse(batch, 'no job can be added to it');
    END IF;
    UPDATE workflow_steps SET pending = pending + jobs
    WHERE workflow_id = batch AND step = 1;
    RETURN first_step;
END
$$;

-- Close open batch ``batch``: no job can be added any more, and the callback runs once
-- every job added has ended (at once, if they all have). False if it was closed already.
CREATE FUNCTION batch_close(batch bigint) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    callback bigint;
    left_to_end integer;
    notified bigint;
BEGIN
    PERFORM 1 FROM workflow_steps WHERE workflow_id = batch AND step = 1 FOR UPDATE;
    UPDATE workflows SET options = options || '{"open": false}'
    WHERE id = batch AND options @> '{"batch": true, "open": true}';
    IF NOT FOUND THEN
        IF EXISTS (SELECT FROM workflows WHERE id = batch AND options @> '{"batch": true}') THEN
            RETURN false;
        END IF;
        PERFORM batch_refuse(batch, 'it cannot be closed');
    END IF;
    UPDATE workflow_steps SET pending = pending - 1
    WHERE workflow_id = batch AND step = 1 AND outcome IS NULL
    RETURNING job_id, pending INTO callback, left_to_end;
    IF left_to_end = 0 THEN
        -- Released as workflow_steps_end (0022) releases a step whose last parent ended.
        WITH moved AS (
            UPDATE jobs AS j
            SET state = CASE WHEN j.ordering_key IS NOT NULL THEN 'blocked'
                             WHEN j.run_at > now() THEN 'scheduled'
                             ELSE 'available' END
            WHERE j.id = callback AND j.state = 'waiting'
            RETURNING j.queue, j.priority, j.run_at, j.state
        )
        SELECT count(*) INTO notified
        FROM (SELECT pg_notify(current_schema() || '.jobs',
                               moved.queue || E'\t' || moved.priority || E'\t'
                               || extract(epoch FROM moved.run_at))
              FROM moved
              WHERE moved.state = 'available') AS told;
    END IF;
    RETURN true;
END
$$;

-- Why ``batch`` refused: closed or cancelled, or no batch at all.
CREATE FUNCTION batch_refuse(batch bigint, what text) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    found_state text;
    found_open boolean;
BEGIN
    SELECT state, (options ->> 'open')::boolean INTO found_state, found_open
    FROM workflows WHERE id = batch AND options @> '{"batch": true}';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'batch % does not exist in this schema (or the transaction that '
            'made it rolled back): %', batch, what USING ERRCODE = '55000';
    END IF;
    RAISE EXCEPTION 'batch % is %: %', batch,
        CASE WHEN found_open THEN found_state ELSE 'closed' END, what
        USING ERRCODE = '55000';
END
$$;

-- Any role that may enqueue may add to a batch and close it (skiplock/grants.py).
REVOKE EXECUTE ON FUNCTION batch_reserve(bigint, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION batch_close(bigint) FROM PUBLIC;
