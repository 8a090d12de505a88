-- skiplock 0028: durable steps. A step a handler runs through skiplock.step() is recorded
-- here when it returns, with its result; a later attempt of the same job (after a
-- failure, a rescue, a deploy) gets the recorded result instead of running it again.
-- Lease mode writes a step fenced by the attempt, as outcomes are (sql/steps.py); a
-- transactional job's steps commit, or roll back, with its transaction.
--
-- No foreign key to jobs: a job leaves that table when it ends, and its steps stay, for
-- `jobs show`, until history maintenance prunes those of ended jobs older than the
-- history retention. Rows are written once and never updated.
CREATE TABLE job_steps (
    job_id    bigint NOT NULL,
    name      text NOT NULL CHECK (name <> '' AND length(name) <= 200),
    attempt   integer NOT NULL,
    result    jsonb,
    done_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, name)
);

-- Pruning finds old steps by time.
CREATE INDEX job_steps_done ON job_steps (done_at);
