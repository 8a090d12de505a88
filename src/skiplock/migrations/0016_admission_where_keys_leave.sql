-- skiplock 0016: a keyed job's successor is admitted by the statement that ends it
-- (decision 017).
--
-- Until now every admission went through the leader: a finished keyed job's row trigger
-- sent a notification naming its key, the leader ran an admission pass for the keys
-- named, and its notification woke a worker to claim. One process admitted for the whole
-- fleet, a pass at a time, and each job paid a notification and two hops more than a job
-- without a key. Now the statement that deletes admitted keyed jobs (a completion, a
-- cancellation, a hand-written DELETE) admits their keys' next jobs itself, once per
-- statement, in its own transaction: they become available when it commits. The leader
-- still admits new keys (the insert trigger asks it), keys whose job went dead or back in
-- line, and every waiting key in its periodic full pass.
--
-- Admitters take turns per key instead of on one lock for the whole schema: each takes
-- the keys' transaction-scoped advisory locks (in one order, so two admitters never wait
-- for each other in a cycle) before the statement that admits, so that statement's
-- snapshot sees what the previous admitter of each key committed. Never over a key's
-- limit, whoever admits. The lock of the whole schema, which admitters before this
-- migration take exclusively, is taken shared: an admitter of the old code (a worker
-- not yet upgraded) still excludes all the others.

-- A safe search_path, fixed on the functions below (SET ... FROM CURRENT): this schema
-- first, then pg_temp last (as in 0012).
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- Take turns with every other admitter of these keys, until the transaction ends.
CREATE FUNCTION keys_lock(wanted text[]) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    schema_lock bigint := hashtextextended(current_schema() || '.admit', 0);
BEGIN
    PERFORM pg_advisory_xact_lock_shared(schema_lock);
    PERFORM pg_advisory_xact_lock(sorted.lock)
    FROM (SELECT DISTINCT hashtextextended(k, schema_lock) AS lock
          FROM unnest(wanted) AS k
          ORDER BY 1) AS sorted;
END
$$;

-- For each key wanted, admit its oldest waiting jobs, oldest first, as many as fit (at
-- most at_most per key; NULL: no such bound), and notify the queues that received jobs
-- (the payload of the insert trigger). Returns the jobs admitted per queue.
--
-- Every job's own key_limit holds while it is admitted: a key never has more admitted
-- jobs (scheduled, available, running, retryable) than the lowest limit among them (jobs
-- of one key may carry different limits: a deploy changed concurrency_limit while they
-- waited, or an ordering key and a concurrency key share a name). So the room is the
-- lowest limit among the admitted jobs and the oldest waiting one, minus the admitted; of
-- the waiting jobs that fit in it, the line is cut before the first job whose own limit
-- (or an older waiting job's) would be exceeded: admitted + place <= lowest limit so far,
-- which once false stays false, so what is admitted is always the head of the line. With
-- a rate (the oldest waiting job's), the room is also the rate minus the admissions
-- logged within the period, and the admission times of rate-limited keys are logged.
-- Periods are compared in seconds (float8), never turned into intervals, so no stored
-- value can overflow the statement for every key.
--
-- The admitting statement runs after keys_lock, so its snapshot is taken once the locks
-- are held (a volatile function takes a new snapshot for each statement).
-- statement_timestamp() of a trigger is that of the statement that fired it: rates are
-- compared with clock_timestamp() instead. A job retried by hand may carry a retry_at
-- from before; it runs at once when admitted.
--
-- Plain index scans only: without VACUUM (held back, or autovacuum off) a key's index
-- entries pile up, one per version of every job it ever had. An index scan marks the
-- dead ones it meets and later scans step over them; a bitmap scan reads every one of
-- them again from the heap, on every admission of the key.
CREATE FUNCTION keys_admit(wanted text[], at_most integer)
RETURNS TABLE (queue text, jobs bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    at timestamptz;
BEGIN
    PERFORM keys_lock(wanted);
    at := clock_timestamp();
    RETURN QUERY
    WITH head AS (
        -- Key by key, an equality on the index of waiting jobs (LATERAL ... LIMIT 1, so
        -- that no plan can turn it into a join that walks the whole index). Keys with no
        -- waiting job drop out here.
        SELECT asked.key, oldest.id, oldest.key_limit, oldest.key_rate, oldest.key_period
        FROM (SELECT DISTINCT k AS key FROM unnest(wanted) AS k) AS asked,
             LATERAL (SELECT o.id, o.key_limit, o.key_rate, o.key_period FROM jobs AS o
                      WHERE o.ordering_key = asked.key AND o.state = 'blocked'
                      ORDER BY o.id LIMIT 1) AS oldest
    ), room AS (
        SELECT head.key, head.id AS head_id, head.key_rate, head.key_period,
               admitted.jobs AS admitted,
               least(
                   least(head.key_limit, admitted.lowest_limit) - admitted.jobs,
                   CASE WHEN head.key_rate IS NOT NULL THEN
                       head.key_rate
                       - (SELECT count(*) FROM key_rates AS r, unnest(r.admissions) AS t
                          WHERE r.key = head.key
                            AND extract(epoch FROM at - t) < head.key_period)
                   END,
                   at_most
               ) AS free
        FROM head,
             LATERAL (SELECT count(*) AS jobs, min(a.key_limit) AS lowest_limit
                      FROM jobs AS a
                      WHERE a.ordering_key = head.key
                        AND a.state IN ('scheduled', 'available', 'running', 'retryable'))
             AS admitted
    ), picked AS (
        -- Room for one: the head, which fits (free counts its own limit). Room for more:
        -- the line read again, and cut where a job's own limit would be exceeded.
        SELECT room.head_id AS id FROM room WHERE room.free = 1
        UNION ALL
        SELECT fits.id
        FROM room,
             LATERAL (SELECT line.id
                      FROM (SELECT oldest.id,
                                   row_number() OVER (ORDER BY oldest.id) AS place,
                                   min(oldest.key_limit) OVER (ORDER BY oldest.id)
                                   AS lowest_limit
                            FROM (SELECT b.id, b.key_limit FROM jobs AS b
                                  WHERE b.ordering_key = room.key AND b.state = 'blocked'
                                  ORDER BY b.id
                                  LIMIT room.free) AS oldest) AS line
                      WHERE room.admitted + line.place <= line.lowest_limit) AS fits
        WHERE room.free > 1
    ), moved AS (
        UPDATE jobs AS j
        SET state = CASE WHEN j.run_at > now() THEN 'scheduled' ELSE 'available' END,
            retry_at = NULL
        -- Picked as blocked in this statement's snapshot, under the keys' locks: only a
        -- cancel or delete can touch such a row meanwhile, and then it is gone. (No state
        -- test here: it would let the planner walk the index of waiting jobs instead.)
        WHERE j.id = ANY(ARRAY(SELECT picked.id FROM picked))
        RETURNING j.queue, j.priority, j.run_at, j.ordering_key
    ), logged AS (
        INSERT INTO key_rates AS r (key, period, admissions)
        SELECT room.key, room.key_period, array_fill(at, ARRAY[count(*)::int])
        FROM moved JOIN room ON room.key = moved.ordering_key
        WHERE room.key_rate IS NOT NULL
        GROUP BY room.key, room.key_period
        ON CONFLICT (key) DO UPDATE
        SET period = EXCLUDED.period,
            admissions = ARRAY(
                SELECT t FROM unnest(r.admissions) AS t
                WHERE extract(epoch FROM at - t) < EXCLUDED.period
                ORDER BY t) || EXCLUDED.admissions
    )
    SELECT notified.queue, notified.jobs
    FROM (SELECT moved.queue, count(*) AS jobs,
                 pg_notify(current_schema() || '.jobs',
                           moved.queue || E'\t' || min(moved.priority) || E'\t'
                           || extract(epoch FROM min(moved.run_at))) AS sent
          FROM moved
          GROUP BY moved.queue) AS notified;
END
$$;

-- Admission where admitted keyed jobs were deleted, from the trigger below. It must never
-- fail the statement that fired it (a completion refused would be taken for a bad
-- result): whatever goes wrong, a lock not had within lock_timeout (a transaction that
-- holds one of the keys for long), a row the database refuses, a role that may not write
-- key_rates, is undone (the block is a subtransaction) and the keys are handed to the
-- leader, as before this migration: one request per key, or one for a full pass. So are
-- more keys than one statement should lock.
CREATE FUNCTION keys_admit_freed(freed text[]) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '100ms'
AS $$
BEGIN
    IF cardinality(freed) <= 256 THEN
        BEGIN
            PERFORM count(*) FROM keys_admit(freed, NULL);
            RETURN;
        EXCEPTION WHEN OTHERS THEN
            NULL;  -- the leader admits them
        END;
    END IF;
    IF cardinality(freed) > 100 THEN
        PERFORM pg_notify(current_schema() || '.control', 'admit');
    ELSE
        PERFORM pg_notify(current_schema() || '.control', 'admit' || E'\t' || k)
        FROM unnest(freed) AS k;
    END IF;
END
$$;

-- Once per DELETE statement. Jobs without keys cost one scan of the deleted rows (no
-- search_path set, no call: this function runs for every completion); the rest is
-- called by name in this table's schema.
CREATE FUNCTION admit_keys_left() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM gone WHERE ordering_key IS NOT NULL AND state <> 'blocked') THEN
        EXECUTE format('SELECT %I.keys_admit_freed($1)', TG_TABLE_SCHEMA)
        USING ARRAY(SELECT DISTINCT ordering_key FROM gone
                    WHERE ordering_key IS NOT NULL AND state <> 'blocked');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER jobs_key_left ON jobs;

CREATE TRIGGER jobs_keys_left
    AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION admit_keys_left();
