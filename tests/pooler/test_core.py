"""The core suite through PgBouncer in transaction mode (see conftest.py).

The tests of the modules imported below run again here, where the application's
connections (``app``, ``conn``, ``autocommit``, ``sem``) go through PgBouncer and each
worker is started with ``pooler=True`` and a direct ``listen_url``. Left out, and why:

- the prefetch test (``test_worker``): its handler reads through a connection of the
  test's own, which prepares statements (what an application behind PgBouncer < 1.21 must
  not do);
- the enqueue behind an uncommitted holder (``test_unique``): it watches a client
  connection's backend pid, which a pooler does not keep.
"""

from __future__ import annotations

from semantics.test_cancel import (  # noqa: F401 (collected here: through the pooler)
    test_a_missed_cancel_notification_is_caught_up_by_the_heartbeat,
    test_a_sync_job_that_returns_early_when_asked_ends_cancelled,
    test_cancel_requested_is_false_outside_a_job,
    test_cancelling_running_async_jobs_cancels_their_handlers,
    test_cancelling_running_sync_jobs_that_check_for_it,
    test_cancelling_waiting_jobs_moves_them_to_history_at_once,
    test_the_cli_cancels_a_running_job,
)
from semantics.test_unique import (  # noqa: F401 (collected here: through the pooler)
    test_a_bad_per_call_unique_scope_fails_before_anything_is_written,
    test_a_dead_job_holds_no_key_and_retrying_it_runs_it_without_the_key,
    test_a_fixed_task_key_and_a_per_call_key_hold_whatever_the_arguments,
    test_a_per_call_window_needs_a_key,
    test_a_rolled_back_enqueue_leaves_the_window_free,
    test_a_task_unique_on_its_arguments_returns_the_holder_whatever_their_order,
    test_a_window_and_the_scope_both_hold,
    test_a_window_refuses_duplicates_after_the_job_finished_until_it_passes,
    test_an_empty_per_call_unique_key_fails,
    test_bad_task_unique_options_fail_at_definition,
    test_bad_windows_fail_at_definition,
    test_enqueue_many_keeps_the_scopes_of_one_key_apart,
    test_enqueue_many_maps_duplicates_to_their_holders_in_input_order,
    test_enqueue_many_with_windows_maps_duplicates_in_order,
    test_maintenance_deletes_windows_that_have_passed,
    test_racing_enqueues_of_one_key_insert_one_row_and_all_get_its_id,
    test_racing_enqueues_of_one_windowed_key_insert_one_job,
    test_retrying_a_dead_transactional_job_with_a_queued_key_runs_it_without_the_key,
    test_retrying_two_dead_jobs_that_share_a_key_retries_both,
    test_the_active_scope_holds_the_key_until_the_job_finishes,
    test_the_async_enqueue_honours_windows,
    test_the_async_enqueue_returns_the_holder_too,
    test_the_queued_scope_frees_the_key_when_the_job_starts,
    test_under_several_workers_jobs_of_one_key_never_run_at_once,
)
from test_enqueue import (  # noqa: F401 (collected here: through the pooler)
    test_a_handler_argument_may_be_called_conn_or_self,
    test_an_int_too_long_to_encode_is_refused_naming_the_argument,
    test_any_json_value_comes_back_equal_from_the_args_column,
    test_async_enqueue_follows_the_transaction_too,
    test_bad_arguments_are_refused_before_anything_is_sent,
    test_bad_per_call_options_are_refused,
    test_enqueue_is_visible_after_commit,
    test_enqueue_many_async,
    test_enqueue_many_inserts_every_job_in_one_statement,
    test_enqueue_many_of_nothing_writes_and_sends_nothing,
    test_enqueue_many_sends_one_notification_per_queue,
    test_large_floats_come_back_as_the_same_floats,
    test_notification_is_sent_at_commit_not_before,
    test_one_bad_job_in_a_batch_is_refused_when_built,
    test_per_call_options_are_stored,
    test_plain_sql_insert_works_and_notifies,
    test_rolled_back_enqueue_leaves_no_job,
    test_rolled_back_enqueue_sends_no_notification,
    test_with_options_does_not_change_the_task,
)
from test_retry import (  # noqa: F401 (collected here: through the pooler)
    test_a_failure_outcome_stores_type_message_and_traceback,
    test_a_handler_retry_becomes_an_outcome_with_that_delay,
    test_a_naive_datetime_is_refused_where_it_is_given,
    test_a_requested_retry_on_the_last_attempt_is_still_dead,
    test_a_requested_retry_time_in_the_past_means_now,
    test_a_requested_retry_time_replaces_the_back_off,
    test_a_steep_policy_is_capped_not_an_overflow,
    test_an_absurd_attempt_number_is_capped_not_an_overflow,
    test_an_impossible_policy_is_refused_when_defined,
    test_delays_stop_growing_at_the_cap,
    test_failure_at_max_attempts_is_dead,
    test_failure_before_the_last_attempt_is_retried_after_the_back_off,
    test_jitter_scales_the_delay_down_by_the_drawn_fraction,
    test_jittered_delay_stays_within_its_bounds,
    test_retry_after_accepts_seconds_timedelta_or_datetime,
    test_retry_exception_keeps_its_request,
    test_the_same_seed_gives_the_same_delays,
    test_unjittered_delays_never_shrink_as_attempts_grow,
    test_without_jitter_delays_grow_exponentially_from_base,
)
from test_worker import (  # noqa: F401 (collected here: through the pooler)
    effects_table,
    test_a_failure_is_stored_counted_and_backed_off,
    test_a_failure_without_back_off_runs_again_at_the_next_poll,
    test_a_graceful_stop_waits_for_the_running_job_and_records_it,
    test_a_handler_asking_to_retry_soon_runs_again,
    test_a_job_behind_the_cursor_that_nobody_announced_is_found_by_the_probe,
    test_a_job_for_an_unknown_task_fails_naming_it_and_the_worker_goes_on,
    test_a_job_reference_waits_for_the_result_or_the_failure,
    test_a_job_still_running_at_the_shutdown_timeout_is_given_back,
    test_a_plain_sql_insert_wakes_an_idle_worker,
    test_a_scheduled_job_runs_once_due_and_not_before,
    test_a_snoozed_job_runs_again_without_using_an_attempt,
    test_a_transactional_handlers_writes_commit_if_and_only_if_the_job_completes,
    test_after_max_attempts_the_job_is_dead_until_retried_by_hand,
    test_an_async_handler_past_its_timeout_fails,
    test_cancelling_a_running_job_stops_it_and_records_it_cancelled,
    test_current_job_outside_a_handler_raises,
    test_many_workers_run_every_job_exactly_once,
    test_polling_finds_a_job_whose_notification_was_lost,
    test_results_are_stored_as_json_or_as_their_repr,
    test_retry_after_from_a_handler_schedules_the_next_attempt,
    test_rows_with_arguments_that_do_not_fit_fail_with_the_type_error,
    test_with_one_slot_lower_priority_values_run_first,
)
