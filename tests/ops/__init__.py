"""Tests of the operator-facing features: cron, periodic jobs, history retention, status,
job and queue admin, doctor, metrics and leader election."""
