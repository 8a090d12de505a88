-- skiplock 0008: keyed jobs (per-key ordering and concurrency) and per-queue limits.
--
-- A job with an ordering_key waits as 'blocked', outside the claim index, until it is
-- admitted: made scheduled or available while fewer than key_limit jobs of its key are
-- admitted (scheduled, available, running, retryable). Admission takes the oldest waiting
-- jobs first, so with key_limit 1 a key's jobs run one at a time in enqueue order; an
-- admitted job keeps its place through retries and leaves it when it finishes or dies.
-- The claim itself is unchanged: it never sees a job that may not run.
--
-- Admission is one statement run by the leader under a transaction-scoped lock (see
-- sql/keys.py). It learns what to do from notifications sent at commit, so it always sees
-- the change that asked for it: the insert trigger asks for waiting keys, and the row
-- triggers below ask when an admitted job leaves (completed, cancelled, dead, deleted).
-- A periodic full pass catches anything a lost notification missed.

ALTER TABLE jobs DROP CONSTRAINT jobs_state_valid;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_valid
    CHECK (state IN ('blocked', 'scheduled', 'available', 'running', 'retryable', 'dead'));

ALTER TABLE jobs ADD COLUMN key_limit smallint NOT NULL DEFAULT 1;
ALTER TABLE jobs ADD CONSTRAINT jobs_key_valid
    CHECK (key_limit >= 1
           AND (ordering_key IS NULL OR char_length(ordering_key) BETWEEN 1 AND 255)
           AND (state <> 'blocked' OR ordering_key IS NOT NULL));

-- The line of waiting jobs per key, oldest first.
CREATE INDEX jobs_key_waiting ON jobs (ordering_key, id) WHERE state = 'blocked';

-- Admitted jobs per key, counted by admission.
CREATE INDEX jobs_key_admitted ON jobs (ordering_key)
    WHERE ordering_key IS NOT NULL
      AND state IN ('scheduled', 'available', 'running', 'retryable');

-- One-at-a-time keys, enforced by the database as well: a second admitted job of such a
-- key (a bug, or a hand-written INSERT that skipped 'blocked') is refused.
CREATE UNIQUE INDEX jobs_key_single ON jobs (ordering_key)
    WHERE ordering_key IS NOT NULL AND key_limit = 1
      AND state IN ('scheduled', 'available', 'running', 'retryable');

-- Per-queue limits, read by the claim of a limited queue (sql/claim.py): at most
-- concurrency_limit jobs running at once, and at most rate_limit started in any
-- rate_period seconds. rate_window holds the start times within the last period (at most
-- rate_limit of them): a sliding window, so no burst at a period's edge exceeds the rate.
ALTER TABLE queues ADD COLUMN concurrency_limit integer;
ALTER TABLE queues ADD COLUMN rate_limit integer;
ALTER TABLE queues ADD COLUMN rate_period double precision;
ALTER TABLE queues ADD COLUMN rate_window timestamptz[] NOT NULL DEFAULT '{}';
ALTER TABLE queues ADD CONSTRAINT queues_limits_valid
    CHECK ((concurrency_limit IS NULL OR concurrency_limit >= 1)
           AND (rate_limit IS NULL) = (rate_period IS NULL)
           AND (rate_limit IS NULL OR rate_limit >= 1)
           AND (rate_period IS NULL OR rate_period > 0));

-- The insert wake-up, now blind to waiting jobs (they cannot be claimed yet) and asking
-- the leader to admit them instead: one request per key, or a single request for a full
-- pass when a statement brought more than 100 keys. One scan of the inserted rows when
-- no job has a key, as before.
CREATE OR REPLACE FUNCTION notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q record;
    waiting boolean := false;
    waiting_keys bigint;
BEGIN
    FOR q IN SELECT queue,
                    min(priority) FILTER (WHERE state <> 'blocked') AS priority,
                    min(run_at) FILTER (WHERE state <> 'blocked') AS run_at,
                    bool_or(state = 'blocked') AS waiting
             FROM inserted GROUP BY queue
    LOOP
        IF q.priority IS NOT NULL THEN
            PERFORM pg_notify(
                TG_TABLE_SCHEMA || '.jobs',
                q.queue || E'\t' || q.priority || E'\t' || extract(epoch FROM q.run_at));
        END IF;
        waiting := waiting OR q.waiting;
    END LOOP;
    IF waiting THEN
        SELECT count(DISTINCT ordering_key) INTO waiting_keys
        FROM inserted WHERE state = 'blocked';
        IF waiting_keys > 100 THEN
            PERFORM pg_notify(TG_TABLE_SCHEMA || '.control', 'admit');
        ELSE
            PERFORM pg_notify(TG_TABLE_SCHEMA || '.control', 'admit' || E'\t' || k)
            FROM (SELECT DISTINCT ordering_key AS k FROM inserted WHERE state = 'blocked') AS d;
        END IF;
    END IF;
    RETURN NULL;
END
$$;

-- An admitted job left its key's admitted set, or a job joined a line by hand (a dead
-- keyed job retried): ask for its key to be admitted again.
CREATE FUNCTION notify_key_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.control', 'admit' || E'\t' || OLD.ordering_key);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_key_left
    AFTER DELETE ON jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.state <> 'blocked')
    EXECUTE FUNCTION notify_key_changed();

CREATE TRIGGER jobs_key_moved
    AFTER UPDATE OF state ON jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND NEW.state IN ('dead', 'blocked')
          AND OLD.state <> NEW.state)
    EXECUTE FUNCTION notify_key_changed();
