-- skiplock 0013: each worker's service restarts, written by its heartbeat, so that
-- `skiplock status` shows a worker whose duties keep failing (worker/supervisor.py).
-- A name with a constant default: no table rewrite, and the table is small anyway; the
-- lock_timeout keeps this from queueing behind a long transaction on it (and every
-- heartbeat behind this).

SET LOCAL lock_timeout = '5s';

ALTER TABLE workers ADD COLUMN service_restarts jsonb NOT NULL DEFAULT '{}'::jsonb;
