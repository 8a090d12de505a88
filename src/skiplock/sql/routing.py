"""Which database a connection is on, for routing queues over several databases."""

# The cluster's identifier (chosen by initdb, kept by its streaming standbys, so a failover
# keeps it; the same through a pooler) and the database's name. Readable by any role.
DATABASE_IDENTITY = """
SELECT system_identifier::text, current_database() FROM pg_control_system()
"""
