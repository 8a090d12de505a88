-- skiplock 0003: one leader per schema runs the maintenance that needs doing once
-- (rescues now; cron and pruning later). Unlogged: after a crash it is simply empty and
-- the workers elect someone again.

CREATE UNLOGGED TABLE leader (
    name       text        PRIMARY KEY,
    worker_id  uuid        NOT NULL,
    elected_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
