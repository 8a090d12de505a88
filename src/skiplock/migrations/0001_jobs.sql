-- skiplock 0001: the hot jobs table, the history table, and the insert wake-up.
-- Runs with search_path set to the target schema, so names are unqualified here.

-- Live jobs only. Finished jobs (completed, cancelled) move to job_history, so this table
-- stays small however much history accumulates. Jobs waiting for a future run_at are
-- 'scheduled' (or 'retryable' after a failure) and are promoted to 'available' when due,
-- so the claim index holds only jobs that can run now.
CREATE TABLE jobs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue            text        NOT NULL DEFAULT 'default',
    task             text        NOT NULL,
    args             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state            text        NOT NULL DEFAULT 'available',
    priority         smallint    NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL DEFAULT 3,
    -- One object per failed attempt: attempt, at, type, message, traceback.
    errors           jsonb       NOT NULL DEFAULT '[]'::jsonb,
    -- Lease: who runs the job and until when. attempts doubles as the fencing token.
    worker_id        uuid,
    lease_expires_at timestamptz,
    -- Reserved for unique jobs and per-key ordering; indexed by the migrations that use them.
    unique_key       text,
    ordering_key     text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    attempted_at     timestamptz,
    CONSTRAINT jobs_state_valid
        CHECK (state IN ('scheduled', 'available', 'running', 'retryable', 'dead')),
    CONSTRAINT jobs_queue_valid CHECK (char_length(queue) BETWEEN 1 AND 128),
    CONSTRAINT jobs_task_valid CHECK (char_length(task) BETWEEN 1 AND 255),
    CONSTRAINT jobs_args_object CHECK (jsonb_typeof(args) = 'object'),
    CONSTRAINT jobs_attempts_valid CHECK (attempts >= 0 AND max_attempts >= 1),
    -- A worker id is set exactly while a job runs in lease mode, so fenced writes can test
    -- worker_id alone (see sql/complete.py).
    CONSTRAINT jobs_lease_iff_running
        CHECK ((state = 'running') = (worker_id IS NOT NULL AND lease_expires_at IS NOT NULL))
) WITH (
    -- Room on each page for HOT updates (heartbeats touch no indexed column), and
    -- vacuum driven by a fixed number of dead rows rather than a share of the table:
    -- every job is inserted, updated and deleted, so the table churns constantly.
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- The claim reads this index in exactly its ORDER BY (a test checks the plan). Lower
-- priority values run first; every column ascends, so a claim can resume from a position
-- with a row comparison instead of walking entries that earlier claims consumed.
CREATE INDEX jobs_claim ON jobs (queue, priority, run_at, id) WHERE state = 'available';

-- The promoter finds jobs coming due; it holds only jobs waiting for their run_at.
CREATE INDEX jobs_waiting ON jobs (run_at) WHERE state IN ('scheduled', 'retryable');

-- The rescuer looks for running jobs by owner; heartbeats do not touch it.
CREATE INDEX jobs_running ON jobs (worker_id) WHERE state = 'running';

-- Append-only record of finished jobs. No primary key, so it can later be partitioned by
-- finished_at and pruned by dropping partitions.
CREATE TABLE job_history (
    id            bigint      NOT NULL,
    queue         text        NOT NULL,
    task          text        NOT NULL,
    args          jsonb       NOT NULL,
    state         text        NOT NULL,
    priority      smallint    NOT NULL,
    attempts      integer     NOT NULL,
    max_attempts  integer     NOT NULL,
    errors        jsonb       NOT NULL,
    result        jsonb,
    unique_key    text,
    ordering_key  text,
    created_at    timestamptz NOT NULL,
    attempted_at  timestamptz,
    finished_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT job_history_state_valid CHECK (state IN ('completed', 'cancelled'))
) WITH (autovacuum_vacuum_insert_scale_factor = 0.01);

CREATE INDEX job_history_id ON job_history (id);
CREATE INDEX job_history_finished_at ON job_history (finished_at);

-- Wake idle workers: one notification per queue per INSERT statement, however many rows,
-- so bulk inserts do not flood the notification queue. NOTIFY is only a wake-up: workers
-- also poll, and the job itself lives in the table. Firing from a trigger means a plain
-- SQL INSERT wakes workers as well as the Python client does.
-- Payload: queue, TAB, lowest priority, TAB, earliest run_at (epoch seconds). A worker
-- whose claim cursor has moved past that position rewinds to it (see sql/claim.py).
CREATE FUNCTION notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(
        TG_TABLE_SCHEMA || '.jobs',
        q.queue || E'\t' || q.priority || E'\t' || extract(epoch FROM q.run_at))
    FROM (SELECT queue, min(priority) AS priority, min(run_at) AS run_at
          FROM inserted GROUP BY queue) AS q;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_inserted
    AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION notify_jobs_inserted();
