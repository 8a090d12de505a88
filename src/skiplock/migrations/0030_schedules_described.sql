-- skiplock 0030: each cron schedule as the workers that tick it describe it, so that
-- `skiplock cron` and the dashboard show and steer schedules without the App: its
-- expression, the job it enqueues (task, queue, priority, attempts, arguments), its
-- missed-ticks policy and next tick. A worker writes the description when it first sees
-- the schedule, when it ticks, and when its App describes it otherwise; `paused` is the
-- operator's alone: a paused schedule's ticks pass without jobs (none are caught up on
-- resume), and `cron run-now` enqueues its job from the description.
ALTER TABLE periodic ADD COLUMN expression text;
ALTER TABLE periodic ADD COLUMN task text;
ALTER TABLE periodic ADD COLUMN queue text;
ALTER TABLE periodic ADD COLUMN priority smallint;
ALTER TABLE periodic ADD COLUMN max_attempts integer;
ALTER TABLE periodic ADD COLUMN args jsonb;
ALTER TABLE periodic ADD COLUMN missed text;
ALTER TABLE periodic ADD COLUMN next_tick timestamptz;
ALTER TABLE periodic ADD COLUMN paused boolean NOT NULL DEFAULT false;
-- A description written by hand that run-now could not enqueue is refused where it is
-- written: the arguments are an object, the names fit the jobs table's.
ALTER TABLE periodic ADD CONSTRAINT periodic_described_valid
    CHECK ((args IS NULL OR jsonb_typeof(args) = 'object')
           AND (task IS NULL OR char_length(task) BETWEEN 1 AND 255)
           AND (queue IS NULL OR char_length(queue) BETWEEN 1 AND 128)
           AND (max_attempts IS NULL OR max_attempts >= 1));
