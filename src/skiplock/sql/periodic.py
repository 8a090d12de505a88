"""Cron ticks: exactly once per tick, by compare-and-set on the last tick recorded."""

PERIODIC_NOW = """
SELECT now()
"""

PERIODIC_GET = """
SELECT last_tick FROM {periodic} WHERE name = %(name)s
"""

# First sight of a schedule: start counting from now, fire nothing yet.
PERIODIC_START = """
INSERT INTO {periodic} (name, last_tick) VALUES (%(name)s, %(tick)s)
ON CONFLICT (name) DO NOTHING
"""

# Only the caller that read `expected` moves it; a concurrent leader finds no row.
PERIODIC_ADVANCE = """
UPDATE {periodic}
SET last_tick = %(tick)s, updated_at = now()
WHERE name = %(name)s AND last_tick = %(expected)s
RETURNING name
"""
