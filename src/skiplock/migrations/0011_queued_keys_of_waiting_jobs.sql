-- skiplock 0011: a keyed job waiting for admission ('blocked', 0008) holds its 'queued'
-- unique key too. 0007's index covered scheduled, available and retryable jobs, but the
-- 'blocked' state came later: a duplicate of a waiting keyed job was accepted, and
-- admitting both then failed on this index, for every key at once.
--
-- Safe to run while workers drain: a lock that cannot be had within lock_timeout fails
-- the migration (run it again) instead of queueing every claim behind it. The table is
-- locked in SHARE mode first, the mode the index build takes anyway (reads go on; writes,
-- claims among them, wait until the commit): so no duplicate can be enqueued between the
-- clean-up below and the build, which would then fail. The new index is built before the
-- old one is dropped, so the drop's ACCESS EXCLUSIVE lock is held only until the commit.
SET LOCAL lock_timeout = '10s';
LOCK TABLE jobs IN SHARE MODE;

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
