-- skiplock 0015: a keyed job's successor is admitted by the statement that ends it
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
-- line, keys a deleting statement could not admit, and its full and periodic passes.
--
-- Admitters take turns per key instead of on one lock for the whole schema: each takes
-- the keys' transaction-scoped advisory locks before the statement that admits, so that
-- statement's snapshot sees what the previous admitter of each key committed: never over
-- a key's limit, whoever admits. A deleting statement waits for its keys (in one order,
-- and at most a moment); the leader takes only the keys no one holds, and comes back
-- for the others. The lock of the whole schema, which admitters before this migration
-- take exclusively, is taken shared: an admitter of the old code (a worker not yet
-- upgraded) still excludes all the others.

-- The two indexes of admitted keyed jobs become one (see the end of this file).
--
-- Safe to run while workers drain, as 0011: the table is locked first, in the one mode
-- every step needs (DROP INDEX needs ACCESS EXCLUSIVE), so no lock is upgraded half-way;
-- a lock not had within migrate's lock_timeout fails the attempt, which migrate retries.
-- Held for the build of one partial index over the table: a few tenths of a second per
-- million live jobs.
LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE;

-- A safe search_path, fixed on the functions below (SET ... FROM CURRENT): this schema
-- first, then pg_temp last (as in 0012).
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- For each key wanted, admit its oldest waiting jobs, oldest first, as many as fit (at
-- most at_most per key; NULL: no such bound), and notify the queues that received jobs
-- (the payload of the insert trigger). Returns the jobs admitted per queue, then a row
-- for each key left alone because another admitter held it.
--
-- First, take turns with every other admitter of these keys, until the transaction ends.
-- With wait, in one order (two such callers never wait for each other in a cycle), as
-- long as lock_timeout allows; without, only the keys no one else holds now (someone is
-- admitting the others right now). With at_most 0 it only takes the locks (KEYS_LOCK).
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
-- The admitting statement runs after the locks are taken, so its snapshot is taken once
-- they are held (a volatile function takes a new snapshot for each statement).
-- statement_timestamp() of a trigger is that of the statement that fired it: rates are
-- compared with clock_timestamp() instead. A job retried by hand may carry a retry_at
-- from before; it runs at once when admitted.
--
-- Plain index scans only: without VACUUM (held back, or autovacuum off) a key's index
-- entries pile up, one per version of every job it ever had. An index scan marks the
-- dead ones it meets and later scans step over them; a bitmap scan reads every one of
-- them again from the heap, on every admission of the key. And one plan per session:
-- planning this statement costs about as much as running it for 30 keys.
CREATE FUNCTION keys_admit(wanted text[], at_most integer, wait boolean)
RETURNS TABLE (queue text, jobs bigint, busy text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    schema_lock bigint := hashtextextended(current_schema() || '.admit', 0);
    held_elsewhere text[] := '{}';
    at timestamptz;
BEGIN
    -- Only a statement that takes its own snapshot sees what the keys' previous admitters
    -- committed: under REPEATABLE READ or SERIALIZABLE (a user's transaction deleting
    -- keyed jobs) the snapshot is the transaction's, and a key could be admitted past its
    -- limit. Refused here; the trigger then hands the keys to the leader.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'keyed jobs are admitted under READ COMMITTED only, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(schema_lock);
    IF wait THEN
        PERFORM pg_advisory_xact_lock(sorted.lock)
        FROM (SELECT DISTINCT hashtextextended(k, schema_lock) AS lock
              FROM unnest(wanted) AS k
              ORDER BY 1) AS sorted;
    ELSE
        SELECT coalesce(array_agg(asked.k), '{}') INTO held_elsewhere
        FROM (SELECT DISTINCT k FROM unnest(wanted) AS k) AS asked
        WHERE NOT pg_try_advisory_xact_lock(hashtextextended(asked.k, schema_lock));
    END IF;
    at := clock_timestamp();
    RETURN QUERY
    WITH head AS (
        -- Key by key, an equality on the index of waiting jobs (LATERAL ... LIMIT 1, so
        -- that no plan can turn it into a join that walks the whole index). Keys with no
        -- waiting job drop out here.
        SELECT asked.key, oldest.tid, oldest.key_limit, oldest.key_rate, oldest.key_period
        FROM (SELECT DISTINCT k AS key FROM unnest(wanted) AS k
              WHERE k <> ALL(held_elsewhere)) AS asked,
             LATERAL (SELECT o.ctid AS tid, o.key_limit, o.key_rate, o.key_period
                      FROM jobs AS o
                      WHERE o.ordering_key = asked.key AND o.state = 'blocked'
                      ORDER BY o.id LIMIT 1) AS oldest
    ), room AS (
        SELECT head.key, head.tid AS head_tid, head.key_rate, head.key_period,
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
        SELECT room.head_tid AS tid FROM room WHERE room.free = 1
        UNION ALL
        SELECT fits.tid
        FROM room,
             LATERAL (SELECT line.tid
                      FROM (SELECT oldest.tid,
                                   row_number() OVER (ORDER BY oldest.id) AS place,
                                   min(oldest.key_limit) OVER (ORDER BY oldest.id)
                                   AS lowest_limit
                            FROM (SELECT b.ctid AS tid, b.id, b.key_limit FROM jobs AS b
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
        -- cancel or delete can touch such a row meanwhile, and then it is gone. Found by
        -- the address the look-up above read it at (a TID scan: no index to descend
        -- again). No state test: it would let the planner walk the index of waiting jobs.
        WHERE j.ctid = ANY(ARRAY(SELECT picked.tid FROM picked))
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
    SELECT notified.queue, notified.jobs, NULL::text
    FROM (SELECT moved.queue, count(*) AS jobs,
                 pg_notify(current_schema() || '.jobs',
                           moved.queue || E'\t' || min(moved.priority) || E'\t'
                           || extract(epoch FROM min(moved.run_at))) AS sent
          FROM moved
          GROUP BY moved.queue) AS notified;
    RETURN QUERY SELECT NULL::text, 0::bigint, k FROM unnest(held_elsewhere) AS k;
END
$$;

-- Once per DELETE statement: the keys of the admitted jobs it deleted are admitted again.
-- Jobs without keys cost one scan of the deleted rows.
--
-- It must never fail the statement that fired it (a completion refused would be taken
-- for a bad result): whatever goes wrong, a lock not had within lock_timeout (a
-- transaction that holds one of the keys for long), a row the database refuses, a role
-- that may not write key_rates, is undone (the block is a subtransaction) and the keys
-- are handed to the leader, as before this migration: one request per key, or one for a
-- full pass when they are many. At most 512 keys are admitted here: each holds a lock
-- until the transaction ends, from the lock table every session shares
-- (max_locks_per_transaction times max_connections: 6,400 by default). A worker's
-- completion batch has at most twice its concurrency of jobs (a hundred at least), so up
-- to 256 slots per process stay within it; the keys beyond go to the leader.
CREATE FUNCTION admit_keys_left() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '100ms'
AS $$
DECLARE
    freed text[];
    leader text[];
BEGIN
    IF NOT EXISTS (SELECT FROM gone WHERE ordering_key IS NOT NULL AND state <> 'blocked') THEN
        RETURN NULL;
    END IF;
    freed := ARRAY(SELECT DISTINCT ordering_key FROM gone
                   WHERE ordering_key IS NOT NULL AND state <> 'blocked');
    leader := freed[513:];
    BEGIN
        PERFORM count(*) FROM keys_admit(freed[1:512], NULL, true);
    EXCEPTION WHEN OTHERS THEN
        leader := freed;  -- the leader admits them all
    END;
    IF cardinality(leader) > 100 THEN
        PERFORM pg_notify(current_schema() || '.control', 'admit');
    ELSIF cardinality(leader) > 0 THEN
        PERFORM pg_notify(current_schema() || '.control', 'admit' || E'\t' || k)
        FROM unnest(leader) AS k;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER jobs_key_left ON jobs;

CREATE TRIGGER jobs_keys_left
    AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION admit_keys_left();

-- One index of admitted keyed jobs instead of two. A keyed job's row is written twice
-- more than a job without a key's (admitted, then claimed), and each write added an
-- entry to both jobs_key_admitted (a key's admitted jobs, counted by admission) and
-- jobs_key_single (the database's own refusal of a second admitted job of a
-- one-at-a-time key): with 2 workers of 200 slots, PostgreSQL's CPU per ordered job
-- fell from about 54 to 44 microseconds with one index doing both. Its second column is
-- 0 for a job of key_limit 1 and the job's id otherwise, so two admitted jobs of limit 1
-- of one key collide and no other pair does: exactly jobs_key_single's refusal, and the
-- rows it held can all be indexed. Admission counts a key's admitted jobs on its first
-- column.
DROP INDEX jobs_key_single;
DROP INDEX jobs_key_admitted;
CREATE UNIQUE INDEX jobs_key_admitted
    ON jobs (ordering_key, (CASE WHEN key_limit = 1 THEN 0 ELSE id END))
    WHERE ordering_key IS NOT NULL
      AND state IN ('scheduled', 'available', 'running', 'retryable');
