"""Cron ticks: exactly once per tick, by compare-and-set on the last tick recorded.

Every worker ticks the schedules its own App defines (decision 021), so several workers
run these statements for one schedule at the same moment; the compare-and-set lets one
of them enqueue each tick.
"""

# The database's clock and the last tick of each of this worker's schedules, in one
# round trip: a schedule no row names yet comes back with a NULL last tick.
PERIODIC_GET_MANY = """
SELECT n.name, p.last_tick, now()
FROM unnest(%(names)s::text[]) AS n(name)
LEFT JOIN {periodic} AS p ON p.name = n.name
"""

# First sight of a schedule: start counting from now, fire nothing yet.
PERIODIC_START = """
INSERT INTO {periodic} (name, last_tick) VALUES (%(name)s, %(tick)s)
ON CONFLICT (name) DO NOTHING
"""

# Only the caller that read `expected` moves it; a concurrent worker waits for the row
# (the winner's transaction holds it only while it inserts the tick's jobs), then finds
# it moved on and returns no row.
PERIODIC_ADVANCE = """
UPDATE {periodic}
SET last_tick = %(tick)s, updated_at = now()
WHERE name = %(name)s AND last_tick = %(expected)s
RETURNING name
"""
