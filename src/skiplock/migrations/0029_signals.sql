-- skiplock 0029: durable waits and signals (decision 027).
--
-- A job that waits for a signal (skiplock.wait_for) ends its attempt: its row becomes
-- 'waiting', outside every index the claim and the promoter read, with the key it waits
-- for, the step its answer is recorded as, and its deadline. The statement that writes a
-- signal for that key (signal(), below) records the payload as that step and makes the
-- job available, in the sender's transaction: a rollback sends nothing. A signal nobody
-- waits for yet is kept in `signals` until a wait takes it or it expires, so a signal sent
-- before the wait is not lost. Each signal goes to one wait, the oldest.
--
-- A signal and a wait for the same key take the same transaction-level advisory lock
-- before either reads, so the two never miss each other: whichever comes second sees the
-- first (its commit, or nothing if it rolled back).
ALTER TABLE jobs ADD COLUMN wait_key text;
ALTER TABLE jobs ADD COLUMN wait_step text;
ALTER TABLE jobs ADD COLUMN wait_until timestamptz;

ALTER TABLE jobs DROP CONSTRAINT jobs_state_valid;
-- A waiting job is a workflow's step, or waits for a signal.
ALTER TABLE jobs ADD CONSTRAINT jobs_state_valid
    CHECK (state IN ('waiting', 'blocked', 'scheduled', 'available', 'running', 'retryable',
                     'dead')
           AND (state <> 'waiting' OR workflow_id IS NOT NULL OR wait_key IS NOT NULL))
    NOT VALID;
ALTER TABLE jobs ADD CONSTRAINT jobs_wait_valid
    CHECK ((wait_key IS NULL AND wait_step IS NULL AND wait_until IS NULL)
           OR (state = 'waiting' AND wait_key IS NOT NULL AND wait_step IS NOT NULL
               AND char_length(wait_key) BETWEEN 1 AND 180
               -- a name job_steps takes: the answer's record can always be written
               AND char_length(wait_step) BETWEEN 1 AND 200))
    NOT VALID;

-- A signal finds the oldest job waiting for its key; the promoter finds waits whose time
-- is up. Both hold only waiting jobs.
CREATE INDEX jobs_signal_waits ON jobs (wait_key, id) WHERE wait_key IS NOT NULL;
CREATE INDEX jobs_wait_deadlines ON jobs (wait_until) WHERE wait_until IS NOT NULL;

CREATE TABLE signals (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key        text NOT NULL CHECK (char_length(key) BETWEEN 1 AND 180),
    payload    jsonb NOT NULL DEFAULT 'null'::jsonb,
    sent_at    timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX signals_key ON signals (key, id);
CREATE INDEX signals_expires ON signals (expires_at);

SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- The signal: to the oldest job waiting for signal_key, which becomes available with the
-- payload recorded as its wait's answer (the job's id is returned), or kept for kept_for
-- when no job waits (NULL is returned). SECURITY DEFINER: the sender needs no privilege
-- on jobs; EXECUTE is granted by `skiplock grant` (every use).
CREATE FUNCTION signal(signal_key text, signal_payload jsonb DEFAULT NULL,
                       kept_for interval DEFAULT interval '7 days') RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    waiter record;
BEGIN
    IF signal_key IS NULL OR char_length(signal_key) NOT BETWEEN 1 AND 180 THEN
        RAISE EXCEPTION 'signal: the key must be a string of 1 to 180 characters, got %',
            coalesce(quote_literal(left(signal_key, 200)), 'NULL') USING ERRCODE = '22023';
    END IF;
    IF kept_for IS NULL OR kept_for <= interval '0' THEN
        RAISE EXCEPTION 'signal: kept_for must be a positive interval, got %',
            coalesce(kept_for::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    PERFORM pg_advisory_xact_lock(
        hashtextextended(current_schema() || '.signal' || E'\t' || signal_key, 0));
    SELECT j.id, j.queue, j.priority, j.run_at, j.attempts, j.wait_step INTO waiter
    FROM jobs AS j
    WHERE j.wait_key = signal_key
    ORDER BY j.id
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF waiter.id IS NULL THEN
        INSERT INTO signals (key, payload, expires_at)
        VALUES (signal_key, coalesce(signal_payload, 'null'::jsonb), now() + kept_for);
        RETURN NULL;
    END IF;
    INSERT INTO job_steps (job_id, name, attempt, result)
    VALUES (waiter.id, waiter.wait_step, waiter.attempts,
            jsonb_build_object('signal', coalesce(signal_payload, 'null'::jsonb)))
    ON CONFLICT (job_id, name) DO NOTHING;
    UPDATE jobs
    SET state = 'available', wait_key = NULL, wait_step = NULL, wait_until = NULL
    WHERE id = waiter.id;
    -- Its place in line may be behind claim cursors: the notification rewinds them.
    PERFORM pg_notify(current_schema() || '.jobs',
                      waiter.queue || E'\t' || waiter.priority || E'\t'
                      || extract(epoch FROM waiter.run_at));
    RETURN waiter.id;
END
$$;
REVOKE EXECUTE ON FUNCTION signal(text, jsonb, interval) FROM PUBLIC;
