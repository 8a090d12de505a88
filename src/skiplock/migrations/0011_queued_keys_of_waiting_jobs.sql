-- skiplock 0011: a keyed job waiting for admission ('blocked', 0008) holds its 'queued'
-- unique key too. 0007's index covered scheduled, available and retryable jobs, but the
-- 'blocked' state came later: a duplicate of a waiting keyed job was accepted, and
-- admitting both then failed on this index, for every key at once.
--
-- Safe to run while workers drain: a lock that cannot be had within migrate's
-- lock_timeout (0.5 s) fails the attempt, which migrate retries, instead of queueing
-- every claim behind it for long. The table is locked first, in the one mode every step
-- needs (the DROP INDEX below needs ACCESS EXCLUSIVE): taking SHARE first and upgrading
-- later deadlocked with a claim that held ROW SHARE and waited for ROW EXCLUSIVE (seen
-- in tests/test_migrations.py's million-row test). Held for the clean-up and the build of
-- a partial index: about 0.3 s per million live jobs on PostgreSQL 15 here. No duplicate
-- can be enqueued between the clean-up and the build.
LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE;

-- Duplicates accepted before this migration: the job holding the key keeps it (the one
-- already admitted, else the oldest); each other one ends dead with the reason and
-- without the key (`skiplock jobs retry` runs it anyway, if it is wanted after all).
UPDATE jobs AS j
SET state = 'dead',
    unique_queued_key = NULL,
    errors = j.errors || jsonb_build_array(jsonb_build_object(
        'attempt', j.attempts,
        'at', now(),
        'type', 'DuplicateJob',
        'message', 'duplicate of job ' || holder.id || ' under the queued unique key '
                   || quote_literal(holder.unique_queued_key)
                   || ', accepted while that job waited for its key (fixed by migration 0011)',
        'traceback', NULL))
FROM (SELECT DISTINCT ON (unique_queued_key) unique_queued_key, id
      FROM jobs
      WHERE unique_queued_key IS NOT NULL
        AND state IN ('blocked', 'scheduled', 'available', 'retryable')
      ORDER BY unique_queued_key, state = 'blocked', id) AS holder
WHERE j.unique_queued_key = holder.unique_queued_key
  AND j.id <> holder.id
  AND j.state IN ('blocked', 'scheduled', 'available', 'retryable');

CREATE UNIQUE INDEX jobs_unique_queued_0011 ON jobs (unique_queued_key)
    WHERE unique_queued_key IS NOT NULL
      AND state IN ('blocked', 'scheduled', 'available', 'retryable');
DROP INDEX jobs_unique_queued;
ALTER INDEX jobs_unique_queued_0011 RENAME TO jobs_unique_queued;
