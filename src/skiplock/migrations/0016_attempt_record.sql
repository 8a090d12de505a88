-- skiplock 0016: when a job first started and which workers took it. Readers that report a
-- job's life (Django's task results: started_at, worker_ids, attempts) need both, and
-- neither can be rebuilt later: attempted_at is overwritten by each attempt, worker_id
-- is cleared when the lease ends. Lease-mode claims set them; they move to history with
-- the job. worker_ids lists every worker that claimed the job, in order, including
-- attempts given back (shutdown, snooze), so it may be longer than attempts.
-- Constant defaults: no table rewrite.

ALTER TABLE jobs ADD COLUMN started_at timestamptz;
ALTER TABLE jobs ADD COLUMN worker_ids uuid[] NOT NULL DEFAULT '{}';
ALTER TABLE job_history ADD COLUMN started_at timestamptz;
ALTER TABLE job_history ADD COLUMN worker_ids uuid[] NOT NULL DEFAULT '{}';
