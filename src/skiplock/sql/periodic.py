"""Cron ticks: exactly once per tick, by compare-and-set on the last tick recorded.

Every worker ticks the schedules its own App defines (decision 021), so several workers
run these statements for one schedule at the same moment; the compare-and-set lets one
of them enqueue each tick.
"""

# The database's clock and the last tick of each of this worker's schedules, in one
# round trip: a schedule no row names yet comes back with a NULL last tick. With them,
# whether an operator paused it, and its description as stored (DESCRIPTION's columns).
PERIODIC_GET_MANY = """
SELECT n.name, p.last_tick, now(), coalesce(p.paused, false),
       p.expression, p.task, p.queue, p.priority, p.max_attempts, p.args, p.missed,
       p.next_tick, p.tags
FROM unnest(%(names)s::text[]) AS n(name)
LEFT JOIN {periodic} AS p ON p.name = n.name
"""

# What a worker writes of a schedule it ticks (migrations 0030, 0033), so that `skiplock cron`
# and the dashboard need no App: the SET list of PERIODIC_START's conflict, of
# PERIODIC_ADVANCE and of PERIODIC_DESCRIBE.
_DESCRIBED = """expression = %(expression)s, task = %(task)s, queue = %(queue)s,
    priority = %(priority)s, max_attempts = %(max_attempts)s, args = %(args)s::jsonb,
    missed = %(missed)s, next_tick = %(next_tick)s, tags = %(tags)s::text[]"""

# First sight of a schedule: start counting from now, fire nothing yet.
PERIODIC_START = """
INSERT INTO {periodic} (name, last_tick, expression, task, queue, priority, max_attempts,
                        args, missed, next_tick, tags)
VALUES (%(name)s, %(tick)s, %(expression)s, %(task)s, %(queue)s, %(priority)s,
        %(max_attempts)s, %(args)s::jsonb, %(missed)s, %(next_tick)s, %(tags)s::text[])
ON CONFLICT (name) DO NOTHING
"""

# A schedule whose App describes it otherwise than its row (a deploy changed it), or whose
# next tick moved without a tick of its own: written, whatever its last tick.
PERIODIC_DESCRIBE = (
    """
UPDATE {periodic} SET """
    + _DESCRIBED
    + """
WHERE name = %(name)s
"""
)

# Only the caller that read `expected` moves it; a concurrent worker waits for the row
# (the winner's transaction holds it only while it inserts the tick's jobs), then finds
# it moved on and returns no row.
PERIODIC_ADVANCE = (
    """
UPDATE {periodic}
SET last_tick = %(tick)s, updated_at = now(), """
    + _DESCRIBED
    + """
WHERE name = %(name)s AND last_tick = %(expected)s
RETURNING name
"""
)

# -- by hand (skiplock cron, the dashboard, Admin) -----------------------------------------

PERIODIC_LIST = """
SELECT name, expression, task, queue, priority, max_attempts, args, missed, last_tick,
       next_tick, paused, updated_at, tags
FROM {periodic} ORDER BY name
"""

PERIODIC_SET_PAUSED = """
UPDATE {periodic} SET paused = %(paused)s WHERE name = %(name)s RETURNING name
"""
