"""The worker process as small supervised services (see ``worker.py`` for how they fit).

``options`` defines every option; ``pools`` opens the connection pools; ``assembly``
builds and wires one run's services; ``shutdown`` is the graceful stop.
``supervisor`` starts, restarts and counts the services; ``listener`` holds the LISTEN
connection and the liveness lock; ``producer`` claims for free capacity, lease-mode jobs
then run in ``leased``, each held as one entry of ``running`` from its claim to its end
(``starts`` records when jobs claimed ahead start), and transactional ones in
``sessions``, under the queue limits of ``limits``; ``stats`` and ``job_log`` subscribe
to the job events (skiplock/events.py); ``heartbeat`` extends leases on a connection of
its own; ``leader`` holds the duties of the elected leader (and promotion and the cursor
probe, which every worker runs); ``timeouts`` bounds their statements.
"""

from skiplock.worker.options import WorkerOptions
from skiplock.worker.stats import WorkerStats
from skiplock.worker.worker import Worker

__all__ = ["Worker", "WorkerOptions", "WorkerStats"]
