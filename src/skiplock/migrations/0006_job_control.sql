-- skiplock 0006: steering running jobs. A cancel request is recorded on the row (the
-- worker hears of it by notification, or at its next heartbeat), and a running job may
-- record its progress as a small JSON value, kept in history when it finishes.

ALTER TABLE jobs ADD COLUMN cancel_requested_at timestamptz;
ALTER TABLE jobs ADD COLUMN progress jsonb;
ALTER TABLE job_history ADD COLUMN progress jsonb;
