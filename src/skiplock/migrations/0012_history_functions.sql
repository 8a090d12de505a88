-- skiplock 0012: history partitions kept by roles that own nothing. Creating and dropping
-- a partition of job_history needs its owner, so the owner (the role running this
-- migration) provides two narrow SECURITY DEFINER functions: one creates the partition
-- of a given day, the other drops the partition of a given day and nothing else. EXECUTE
-- is revoked from PUBLIC; `skiplock grant --worker|--admin` grants it.

-- A safe search_path, fixed on each function below (SET ... FROM CURRENT): this schema
-- first, then pg_temp last, so no temporary object of the caller can stand in for ours.
-- pg_catalog is searched before both.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- Bounds are the day's midnights in UTC, as 0001 and maintenance name them. The caller
-- sets lock_timeout: a long transaction holding job_history makes this fail fast with
-- lock_not_available, and rows of that day already in DEFAULT with check_violation.
CREATE FUNCTION history_partition_create(day date) RETURNS void
LANGUAGE plpgsql STRICT SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    EXECUTE format(
        'CREATE TABLE IF NOT EXISTS %I PARTITION OF job_history FOR VALUES FROM (%L) TO (%L)',
        'job_history_p' || to_char(day, 'YYYYMMDD'),
        day::timestamp AT TIME ZONE 'UTC',
        (day + 1)::timestamp AT TIME ZONE 'UTC');
END
$$;

-- Only a daily partition of this schema's job_history: a table that merely has the name
-- is left alone.
CREATE FUNCTION history_partition_drop(day date) RETURNS void
LANGUAGE plpgsql STRICT SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    partition text := 'job_history_p' || to_char(day, 'YYYYMMDD');
BEGIN
    IF EXISTS (SELECT FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'job_history'::regclass
                 AND c.relname = partition
                 AND c.relnamespace = (SELECT relnamespace FROM pg_class
                                       WHERE oid = 'job_history'::regclass))
    THEN
        EXECUTE format('DROP TABLE %I', partition);
    END IF;
END
$$;

REVOKE EXECUTE ON FUNCTION history_partition_create(date) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION history_partition_drop(date) FROM PUBLIC;
