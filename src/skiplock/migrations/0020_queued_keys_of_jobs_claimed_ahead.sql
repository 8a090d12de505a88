-- skiplock 0020: a job claimed ahead keeps its 'queued' unique key until it really starts.
-- A worker may claim jobs before it has a slot for them (decision 018); such a job waits,
-- running in the table but unstarted, and may be given back. Until now the claim dropped
-- the key, so a duplicate was accepted while the first job had not started, and a job
-- given back unstarted came back without its key. The claim now leaves the key on a job
-- claimed ahead (released just before it starts: sql/claim.py, JOB_START_KEYED), so the
-- index that enforces the scope covers running rows too. A running row whose job started
-- holds no key, as before.
--
-- Locked as 0011 is (see there): one ACCESS EXCLUSIVE lock for the clean-up and the build,
-- taken within migrate's lock_timeout or retried; about 0.3 s per million live jobs. (A
-- concurrent build would not block claims, but it waits for every transaction, a second
-- `migrate` waiting for the advisory lock included, which waits for this one: deadlock.)
LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE;

-- Until now no claim left a key on a running row; one written so by hand would block the
-- build if another job holds the same key. It has started, as far as anyone knows.
UPDATE jobs SET unique_queued_key = NULL
WHERE state = 'running' AND unique_queued_key IS NOT NULL;

CREATE UNIQUE INDEX jobs_unique_queued_0020 ON jobs (unique_queued_key)
    WHERE unique_queued_key IS NOT NULL
      AND state IN ('blocked', 'scheduled', 'available', 'retryable', 'running');
DROP INDEX jobs_unique_queued;
ALTER INDEX jobs_unique_queued_0020 RENAME TO jobs_unique_queued;
