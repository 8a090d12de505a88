"""The worker process as small supervised services (see ``worker.py`` for how they fit).

``supervisor`` starts, restarts and counts the services; ``listener`` holds the LISTEN
connection and the liveness lock; ``producer`` claims for free capacity; ``heartbeat``
extends leases on a connection of its own; ``leader`` holds the duties of the elected
leader (and promotion and the cursor probe, which every worker runs).
"""

from skiplock.worker.worker import Worker, WorkerStats

__all__ = ["Worker", "WorkerStats"]
