"""Workers behind PgBouncer with no direct URL at all: no listener, no liveness lock.

A few of the core tests again (see test_core.py), with every worker started
``pooler=True`` and nothing else: it polls (0.2 s by default; these tests' own intervals
where they set one), its running jobs' cancellation arrives with the heartbeat, and a
dead worker's jobs wait for their lease.
"""

from __future__ import annotations

import pytest

from semantics.test_cancel import (  # noqa: F401 (collected here: through the pooler)
    test_a_missed_cancel_notification_is_caught_up_by_the_heartbeat,
    test_cancelling_waiting_jobs_moves_them_to_history_at_once,
)
from semantics.test_unique import (  # noqa: F401 (collected here: through the pooler)
    test_under_several_workers_jobs_of_one_key_never_run_at_once,
)
from test_worker import (  # noqa: F401 (collected here: through the pooler)
    effects_table,
    test_a_failure_is_stored_counted_and_backed_off,
    test_a_scheduled_job_runs_once_due_and_not_before,
    test_a_snoozed_job_runs_again_without_using_an_attempt,
    test_a_transactional_handlers_writes_commit_if_and_only_if_the_job_completes,
    test_many_workers_run_every_job_exactly_once,
    test_with_one_slot_lower_priority_values_run_first,
)


@pytest.fixture
def worker_mode() -> str:
    return "poll-only"
