-- skiplock 0021: an insert notifies only while a worker waits for it (decision 023).
--
-- pg_notify makes the inserting transaction take one database-wide lock at commit and hold
-- it through the commit's flush, so transactions that notify commit one at a time. Every
-- enqueue used to notify; applications with many concurrent requests paid for it with a
-- third of their commit rate (decision 016). Now:
--
-- * A worker with nothing to do becomes its queue's sentinel: it holds an exclusive
--   session-level advisory lock on the queue's "waiting" key (worker/sentinel.py). The
--   insert trigger tries a shared transaction-level lock on the same key; only when that
--   fails (a sentinel holds it) does it notify. Busy fleets take no notification lock.
-- * The same lock closes the race of a worker going to sleep while an insert commits: the
--   shared lock, once taken, is held until the inserting transaction ends, and a worker
--   can become sentinel only while no inserter holds it. An insert that saw no sentinel has
--   therefore committed (or rolled back) before any worker sleeps, and the sentinel's
--   claim after taking the lock finds its job. Advisory locks ignore snapshots, so this
--   holds at every isolation level.
-- * A busy worker no longer hears of jobs that commit behind its claim cursor (decision
--   006). Each job now records the transaction that inserted it (enqueued_xid); a probe
--   every few milliseconds reads the jobs of transactions that were still in progress at
--   its previous snapshot (worker/wakeup.py), through the index below, and rewinds the
--   cursor to them.
--
-- Workers of earlier releases never become sentinels: once this migration has applied,
-- inserts wake them only through their poll (every second by default) until they are
-- replaced by workers of this release.
--
-- Nullable and without a rewrite: rows from before this migration keep NULL, which no
-- probe asks for (they are older than any snapshot a probe has taken). Not granted to the
-- enqueue role (0019), so a job's inserter cannot write it; the default always applies.
ALTER TABLE jobs ADD COLUMN enqueued_xid xid8;
ALTER TABLE jobs ALTER COLUMN enqueued_xid SET DEFAULT pg_current_xact_id();

-- Ready jobs by the transaction that inserted them: the late-commit read (sql/wakeup.py,
-- JOB_LATE_COMMITS) starts at the recent end of each queue's part, and id comes last so
-- that a read can resume within one transaction's jobs. Built under the lock ADD COLUMN
-- took, over rows that all have NULL here: it reads the table (about 0.3 s per million
-- jobs) and holds no entry yet. (A concurrent build would not block claims meanwhile, but
-- it waits for every transaction, a second `migrate` waiting for the advisory lock
-- included, which waits for this one: deadlock; see 0020.)
CREATE INDEX jobs_enqueued ON jobs (queue, enqueued_xid, id)
    WHERE state = 'available' AND enqueued_xid IS NOT NULL;


-- The wake-up, notifying a queue's ready jobs only when a sentinel waits on it (or when a
-- worker is about to become one: it queues for the lock, and the try fails). Jobs
-- scheduled within the next second still notify unconditionally: a worker's promotion
-- sleeps up to its poll interval (one second by default) and would start them late. Their
-- position says the lowest priority there is, so that no claim cursor rewinds for them:
-- only promotion makes them ready, and it notifies again (decision 006).
-- Waiting keyed jobs ask the leader for admission, as before (0008).
CREATE OR REPLACE FUNCTION notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q record;
    waiting boolean := false;
    waiting_keys bigint;
    seed bigint := hashtextextended(TG_TABLE_SCHEMA || '.waiting', 0);
BEGIN
    FOR q IN SELECT queue,
                    min(priority) FILTER (WHERE state = 'available') AS priority,
                    min(run_at) FILTER (WHERE state = 'available') AS run_at,
                    min(run_at) FILTER (WHERE state = 'scheduled') AS due,
                    bool_or(state = 'blocked') AS waiting
             FROM inserted GROUP BY queue
    LOOP
        IF q.priority IS NOT NULL
           AND NOT pg_try_advisory_xact_lock_shared(hashtextextended(q.queue, seed)) THEN
            PERFORM pg_notify(
                TG_TABLE_SCHEMA || '.jobs',
                q.queue || E'\t' || q.priority || E'\t' || extract(epoch FROM q.run_at));
        END IF;
        IF q.due IS NOT NULL AND q.due < statement_timestamp() + interval '1 second' THEN
            PERFORM pg_notify(
                TG_TABLE_SCHEMA || '.jobs',
                q.queue || E'\t' || 32767 || E'\t' || extract(epoch FROM q.due));
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
