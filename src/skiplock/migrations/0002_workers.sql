-- skiplock 0002: worker registration, so operators (and the rescuer) can see who is alive.

CREATE TABLE workers (
    id           uuid        PRIMARY KEY,
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    queues       text[]      NOT NULL,
    concurrency  integer     NOT NULL,
    -- false behind a transaction-mode pooler: no advisory lock, rescued by lease only.
    holds_lock   boolean     NOT NULL DEFAULT true,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now()
);
