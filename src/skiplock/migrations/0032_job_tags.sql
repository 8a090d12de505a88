-- skiplock 0032: tags, to find jobs by what they are about (`with_options(tags=[...])`,
-- `skiplock jobs list --tag`, the dashboard's tag filter). They live in the job's meta,
-- as "tags": ["billing", "eu"], which every statement that moves a job to history
-- carries already. The filter is meta ? 'tags' AND meta -> 'tags' @> '["billing"]': the
-- first half repeats the predicate of these partial GIN indexes so that the planner can
-- match them. Untagged jobs cost the indexes nothing, on the hot table or in history.
--
-- job_history is partitioned, and PostgreSQL cannot build an index CONCURRENTLY on a
-- partitioned table: the build holds back inserts into history (completions) while it
-- runs, a read of the table with no job tagged yet. New partitions inherit the index.

SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

CREATE INDEX IF NOT EXISTS jobs_tags ON jobs
    USING gin ((meta -> 'tags') jsonb_path_ops) WHERE meta ? 'tags';
CREATE INDEX IF NOT EXISTS job_history_tags ON job_history
    USING gin ((meta -> 'tags') jsonb_path_ops) WHERE meta ? 'tags';

-- The planner ignores the statistics of a partial index's expression, and without any it
-- guesses that a tag matches a few rows in a thousand: a rare tag's page then walked the
-- id index across a million history rows (0.5 s) instead of reading the GIN index
-- (0.1 ms). Statistics on the expression itself (PostgreSQL 14 and later) tell rare tags
-- from common ones. They are per table, so each history partition gets its own, made by
-- history_partition_create from now on; ANALYZE (autovacuum) fills them.
CREATE FUNCTION tags_statistics_create(partition regclass) RETURNS void
LANGUAGE plpgsql STRICT SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF current_setting('server_version_num')::int >= 140000 THEN
        EXECUTE format('CREATE STATISTICS IF NOT EXISTS %I ON (meta -> ''tags'') FROM %s',
                       (SELECT relname FROM pg_class WHERE oid = partition) || '_tags',
                       partition);
    END IF;
END
$$;
REVOKE EXECUTE ON FUNCTION tags_statistics_create(regclass) FROM PUBLIC;

SELECT tags_statistics_create('jobs'::regclass);
SELECT tags_statistics_create(inhrelid::regclass)
FROM pg_inherits WHERE inhparent = 'job_history'::regclass;

CREATE OR REPLACE FUNCTION history_partition_create(day date) RETURNS void
LANGUAGE plpgsql STRICT SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    partition text := 'job_history_p' || to_char(day, 'YYYYMMDD');
    made regclass;
BEGIN
    EXECUTE format(
        'CREATE TABLE IF NOT EXISTS %I PARTITION OF job_history FOR VALUES FROM (%L) TO (%L)',
        partition,
        day::timestamp AT TIME ZONE 'UTC',
        (day + 1)::timestamp AT TIME ZONE 'UTC');
    -- Only a partition of job_history: a table that merely has the name is left alone.
    SELECT i.inhrelid::regclass INTO made
    FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'job_history'::regclass AND c.relname = partition
      AND c.relnamespace = (SELECT relnamespace FROM pg_class
                            WHERE oid = 'job_history'::regclass);
    IF made IS NOT NULL THEN
        PERFORM tags_statistics_create(made);
    END IF;
END
$$;
