"""Which database a connection is on, for routing queues over several databases."""

# The cluster's identifier (chosen by initdb, kept by its streaming standbys, so a failover
# keeps it; the same through a pooler) and the database's oid (a database dropped and
# created again under its old name is another database). Readable by any role.
DATABASE_IDENTITY = """
SELECT s.system_identifier::text, d.oid::text
FROM pg_control_system() AS s, pg_database AS d
WHERE d.datname = current_database()
"""
