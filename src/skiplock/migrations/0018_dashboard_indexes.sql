-- skiplock 0018: indexes for the dashboard's jobs pages (skiplock.sql.dashboard).
--
-- Pages are keyset-paginated newest first (id < cursor ORDER BY id DESC). Unfiltered, or
-- with a filter most rows pass, the id index finds a page at once. A filter few history
-- rows pass (a small queue, a rare task, an error class) would walk the id index across
-- the whole history to fill one page: 0.1-0.45 s at 1,000,000 rows. These indexes serve
-- such filters in the pages' own order. The hot jobs table gets none: every index there is
-- paid for by every enqueue, claim and completion, and a scan of its live rows stays cheap.
--
-- job_history is partitioned, and PostgreSQL cannot build an index CONCURRENTLY on a
-- partitioned table: each build holds back inserts into history (completions) while it
-- runs, about a second per million rows here. New partitions inherit the indexes.

CREATE INDEX IF NOT EXISTS job_history_queue_id ON job_history (queue, id);
CREATE INDEX IF NOT EXISTS job_history_task_id ON job_history (task, id);

-- The error-class filter (errors @> '[{"type": ...}]') on jobs that failed before they
-- finished, a few in a hundred: a small GIN index (the filter repeats the predicate so
-- that the planner can match it). Rows without errors cost it nothing.
CREATE INDEX IF NOT EXISTS job_history_failed_errors ON job_history
    USING gin (errors jsonb_path_ops) WHERE errors <> '[]'::jsonb;
