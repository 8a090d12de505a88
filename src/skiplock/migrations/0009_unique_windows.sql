-- skiplock 0009: unique keys with a time window ("at most one per hour"). A window
-- outlives the job (it may finish in a second), so it cannot live in the jobs table's
-- partial indexes: each windowed key has a row here, taken by INSERT ... ON CONFLICT and
-- free again once expires_at has passed. Only jobs enqueued with a window touch it; the
-- leader deletes expired rows.

CREATE TABLE unique_windows (
    key        text        PRIMARY KEY,
    job_id     bigint      NOT NULL,
    expires_at timestamptz NOT NULL
);

CREATE INDEX unique_windows_expires_at ON unique_windows (expires_at);
