"""The Prometheus queue gauges' one statement (skiplock/metrics.py)."""

# Live jobs per queue and state, and per state the age of the oldest job that is due (its
# retry_at after a failure), in one pass over the jobs table and nothing else.
#
# Counting a backlog is as dear as the backlog is long, whatever the path: measured on
# PostgreSQL 15 over 937,000 jobs (600,000 scheduled, 300,000 available), this takes
# 170 ms; reading each state through its partial index instead takes 240 ms (the queue of
# a scheduled job is only in the heap); QUEUE_STATS, which `skiplock status` runs, takes
# 280 ms (it scans jobs twice and history once). So the cost is bounded by how often it
# runs, not by the plan: the collector runs it at most once per refresh period, whatever
# the scrape rate, with a statement timeout, and serves the figures it last read.
QUEUE_GAUGES = """
SELECT queue, state, count(*) AS jobs,
       extract(epoch FROM now() - min(greatest(run_at, retry_at)) FILTER (
           WHERE state IN ('available', 'scheduled', 'retryable')
             AND greatest(run_at, retry_at) <= now()))::float8 AS oldest_ready_seconds
FROM {jobs}
GROUP BY queue, state
"""

# A scrape must not hang on a slow count (a lock, an overloaded server): the collector
# gives up after this and serves the figures it read last.
GAUGES_STATEMENT_TIMEOUT = "-c statement_timeout=5000"

# What else a scrape reports about the whole database, in one cheap statement next to
# QUEUE_GAUGES: every id the jobs' sequence has handed out (a counter of jobs enqueued,
# through any client or plain SQL; it also counts ids drawn by enqueues that rolled back
# and by unique jobs that turned out duplicates: an upper bound, which only ever grows),
# and the workers registered now with their slots (a crashed worker's row is removed by
# the leader's rescue within seconds).
ENQUEUED_AND_WORKERS = """
SELECT pg_sequence_last_value(pg_get_serial_sequence(%(table)s, 'id')::regclass),
       (SELECT count(*) FROM {workers}),
       (SELECT coalesce(sum(concurrency), 0) FROM {workers})
"""

# Workflows and batches per state (running, and those ended but not yet pruned with
# history: skiplock/history.py), beside the queue gauges.
WORKFLOW_GAUGES = """
SELECT state, count(*) FROM {workflows} GROUP BY state
"""
