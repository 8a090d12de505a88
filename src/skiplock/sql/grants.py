"""Privileges for a role that owns nothing (``skiplock grant``). Identifiers and privilege
lists are composed by skiplock.grants from fixed names; nothing here takes a value.
"""

GRANT_SCHEMA_USAGE = """
GRANT USAGE ON SCHEMA {schema} TO {role}
"""

# Before a GRANT that must be all a role holds on a table (skiplock.grants.REVOKED).
REVOKE_TABLE = """
REVOKE {privileges} ON TABLE {table} FROM {role}
"""

GRANT_TABLE = """
GRANT {privileges} ON TABLE {table} TO {role}
"""

# A bulk enqueue takes an id from the jobs table's identity sequence before its COPY and
# reads currval after it; a windowed unique enqueue takes one as its window's stand-in
# (nextval and currval need USAGE). Taking ids by hand is harmless: no statement writes an
# id (decision 022), so a skipped id is only a gap. Every sequence in the schema is such
# an id sequence.
GRANT_SEQUENCES = """
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}
"""

GRANT_FUNCTION = """
GRANT EXECUTE ON FUNCTION {function} TO {role}
"""
