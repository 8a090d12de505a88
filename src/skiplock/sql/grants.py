"""Privileges for a role that owns nothing (``skiplock grant``). Identifiers and privilege
lists are composed by skiplock.grants from fixed names; nothing here takes a value.
"""

GRANT_SCHEMA_USAGE = """
GRANT USAGE ON SCHEMA {schema} TO {role}
"""

GRANT_TABLE = """
GRANT {privileges} ON TABLE {table} TO {role}
"""

# Bulk and unique enqueues take ids from the jobs table's identity sequence (nextval needs
# USAGE). Every sequence in the schema is such an id sequence.
GRANT_SEQUENCES = """
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}
"""

GRANT_FUNCTION = """
GRANT EXECUTE ON FUNCTION {function} TO {role}
"""
