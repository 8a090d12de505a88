-- skiplock 0004: per-queue settings; for now whether the queue is paused. A queue needs
-- no row here to exist: rows are written by `skiplock queues pause/resume`.

CREATE TABLE queues (
    name       text        PRIMARY KEY,
    paused     boolean     NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);
