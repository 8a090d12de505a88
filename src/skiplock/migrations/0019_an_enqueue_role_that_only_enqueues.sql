-- skiplock 0019: an enqueue right that only enqueues, and leases a worker could write
-- (decision 022).
--
-- Each worker registers the length of the leases it writes, so the rescuer can tell a
-- lease its worker wrote from one written by hand: a worker's lease never ends more than
-- that far ahead. NULL: a worker of an earlier release (no such test for its jobs).
-- A name without a default: no table rewrite; the lock_timeout keeps this from queueing
-- behind a long transaction on the table (and every heartbeat behind this).

SET LOCAL lock_timeout = '5s';

ALTER TABLE workers ADD COLUMN lease_seconds double precision;

-- Until now `skiplock grant` gave INSERT on the whole jobs table, id and lease columns
-- included: a role that only enqueues could take the ids the application's next
-- enqueues would get (they then failed on the primary key, rolling back the
-- application's transaction), or insert running rows under a made-up worker. Every role
-- other than the owner that holds that table-wide INSERT keeps INSERT on the columns an
-- enqueue writes (skiplock/grants.py, ENQUEUE_COLUMNS; a test compares the two lists)
-- and loses the rest. Revoking the table's privilege revokes it on each column too.
DO $$
DECLARE
    grantee_name text;
BEGIN
    FOR grantee_name IN
        SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END
        FROM pg_class AS c
        CROSS JOIN LATERAL aclexplode(c.relacl) AS a
        LEFT JOIN pg_roles AS r ON r.oid = a.grantee
        WHERE c.oid = 'jobs'::regclass
          AND a.privilege_type = 'INSERT'
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('REVOKE INSERT ON TABLE jobs FROM %s', grantee_name);
        EXECUTE format(
            'GRANT INSERT (queue, task, args, priority, run_at, state, max_attempts, '
            'unique_key, unique_queued_key, ordering_key, key_limit, key_rate, key_period, '
            'meta) ON TABLE jobs TO %s',
            grantee_name);
    END LOOP;
END
$$;
