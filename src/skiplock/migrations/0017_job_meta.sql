-- skiplock 0017: what a job carries besides its arguments, for skiplock itself: the
-- trace context of the code that enqueued it (skiplock.contrib.otel), so that the worker's
-- span of each attempt links to the enqueuing trace. Not in args: those are checked
-- against the handler's signature. NULL (nothing stored) unless tracing is on; it moves
-- to history with the job. No default: no table rewrite.

SET LOCAL lock_timeout = '5s';

ALTER TABLE jobs ADD COLUMN meta jsonb;
ALTER TABLE job_history ADD COLUMN meta jsonb;
