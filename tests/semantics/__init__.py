"""Tests of job semantics: unique jobs, snoozing, results, cancelling, progress and
timeouts, each against real workers on a schema of the test's own."""
