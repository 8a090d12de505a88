"""Confirming what a control-channel message asks for (see skiplock/control.py)."""

from skiplock.sql.fence import HELD_IDS

# A cancel request arrives as a notification, which any role that can connect may send:
# it is acted on only when the job's row says it was asked for (JOB_CANCEL_RUNNING in
# sql/admin.py sets cancel_requested_at), for the attempt this worker runs. By id, like
# every batch lookup (ROBUST_LOOKUP in sql/complete.py).
JOB_CANCEL_CONFIRMED = (
    """
SELECT j.id
FROM {jobs} AS j
WHERE """
    + HELD_IDS
    + """
  AND j.state = 'running'
  AND j.cancel_requested_at IS NOT NULL
"""
)
