"""The fence on every write a worker makes to jobs it holds.

A claim gives the job to one worker for one attempt (attempts + 1 is the token). Every
later write of that worker (outcomes, lease extensions, marks, give-backs) matches a row
only while the row still names this worker at that attempt. A worker whose lease ran
out and whose job was rescued or claimed again elsewhere matches nothing, so it can
never mark the job done. Each row's attempt is looked up by id in %(batch)s, a jsonb
object keyed by job id (decision 013).
"""

# The row (aliased j) is still this worker's, at the attempt %(batch)s names for it.
HELD = """j.attempts = (%(batch)s::jsonb -> j.id::text ->> 'attempt')::int
      AND j.worker_id = %(worker_id)s"""

# The same for the rows of %(ids)s, found by an index condition in any plan.
HELD_IDS = (
    """j.id = ANY(%(ids)s::bigint[])
      AND """
    + HELD
)
