-- skiplock 0005: the last tick enqueued for each periodic (cron) task. Advancing it is a
-- compare-and-set in the same transaction as the tick's job, so each tick is enqueued
-- exactly once however many leaders (or split brains) try.

CREATE TABLE periodic (
    name       text        PRIMARY KEY,
    last_tick  timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
