-- skiplock 0007: unique jobs. A key is held by a live job in its scope, enforced by a
-- partial unique index and INSERT ... ON CONFLICT (never advisory locks):
--   unique_key         scope 'active': held while scheduled, available, running, retryable
--   unique_queued_key  scope 'queued': held until the job first starts (the claim clears it,
--                      so a retry can never collide with a newer duplicate)
-- Dead jobs hold no key: once a job is parked for a human, a fresh one may be enqueued.

ALTER TABLE jobs ADD COLUMN unique_queued_key text;

CREATE UNIQUE INDEX jobs_unique_active ON jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state <> 'dead';

CREATE UNIQUE INDEX jobs_unique_queued ON jobs (unique_queued_key)
    WHERE unique_queued_key IS NOT NULL AND state IN ('scheduled', 'available', 'retryable');
