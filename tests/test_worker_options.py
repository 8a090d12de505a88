"""WorkerOptions: the one place each worker option is defined, checked and turned into
flags. No database: these are the options' own rules."""

from __future__ import annotations

import argparse
from datetime import timedelta

import pytest

import skiplock
from skiplock.errors import ConfigurationError
from skiplock.pooler import LISTEN_URL_ENV, POLL_INTERVAL, POLL_ONLY_INTERVAL
from skiplock.worker.options import WorkerOptions, add_arguments, child_arguments

URL = "postgresql://nobody@127.0.0.1:1/none"


def parse(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args(argv))


def test_the_flags_default_to_the_options_defaults() -> None:
    assert WorkerOptions.from_arguments(parse(), {}) == WorkerOptions()


def test_flags_become_options_with_their_units_and_switches() -> None:
    given = parse(
        "--concurrency=4",
        "--prefetch=auto",
        "--lease=12.5",
        "--history-retention-days=0",
        "--tcp-user-timeout=0",
        "--no-liveness-lock",
        "--pooler",
        "--no-listen",
    )
    options = WorkerOptions.from_arguments(given, {}, queues=("a", "b"))
    assert options == WorkerOptions(
        queues=("a", "b"),
        concurrency=4,
        prefetch=None,
        lease_seconds=12.5,
        history_retention=None,
        tcp_user_timeout=None,
        liveness_lock=False,
        pooler=True,
        listen=False,
    )
    assert WorkerOptions.from_arguments(
        parse("--history-retention-days=1.5"), {}
    ).history_retention == timedelta(days=1.5)


def test_the_listen_url_comes_from_the_environment_and_goes_to_a_child_through_it() -> None:
    options = WorkerOptions.from_arguments(parse(), {LISTEN_URL_ENV: URL})
    assert options.listen_url == URL
    environ: dict[str, str] = {}
    argv = child_arguments(parse("--listen-url", URL, "--concurrency=3"), environ)
    assert URL not in argv and environ == {LISTEN_URL_ENV: URL}
    assert argv == [
        "--concurrency",
        "3",
        "--prefetch",
        "auto",
        "--lease",
        "30",
        "--shutdown-timeout",
        "30",
        "--history-retention-days",
        "7",
        "--tcp-user-timeout",
        "30",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        (),
        ("--concurrency=7", "--prefetch=0", "--lease=0.1", "--poll-interval=2.25"),
        ("--history-retention-days=0.5", "--tcp-user-timeout=12.3456789", "--pooler"),
        ("--no-listen", "--no-liveness-lock", "--shutdown-timeout=0"),
    ],
)
def test_a_child_of_processes_gets_exactly_the_options_it_was_given(argv: tuple[str, ...]) -> None:
    given = parse(*argv)
    child = parse(*child_arguments(given, {}))
    assert WorkerOptions.from_arguments(child, {}) == WorkerOptions.from_arguments(given, {})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"queues": ()}, "at least one queue"),
        ({"queues": "emails"}, "list of queue names"),
        ({"queues": ("bad queue!",)}, "queue"),
        ({"concurrency": 0}, "concurrency must be an integer >= 1, got 0"),
        ({"concurrency": True}, "concurrency must be"),
        ({"prefetch": -1}, "prefetch must be None"),
        ({"lease_seconds": 0}, "lease_seconds must be positive"),
        ({"poll_interval": float("nan")}, "poll_interval must be positive"),
        ({"tcp_user_timeout": -1.0}, "tcp_user_timeout must be positive"),
        ({"listen_url": " "}, "listen_url is empty"),
    ],
)
def test_a_bad_option_is_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        WorkerOptions(**fields)  # type: ignore[arg-type]


def test_queues_keep_their_order_once_each() -> None:
    assert WorkerOptions(queues=["b", "a", "b"]).queues == ("b", "a")  # type: ignore[arg-type]


def test_what_follows_from_several_options() -> None:
    assert WorkerOptions().poll_seconds == POLL_INTERVAL
    polling = WorkerOptions(listen=False)
    assert not polling.listens and polling.poll_seconds == POLL_ONLY_INTERVAL
    pooled = WorkerOptions(pooler=True)  # nowhere to LISTEN, no session locks
    assert not pooled.listens and not pooled.holds_liveness_lock
    assert WorkerOptions(pooler=True, listen_url=URL).holds_liveness_lock


def test_a_worker_takes_options_or_keywords_and_refuses_unknown_ones() -> None:
    app = skiplock.App(URL)
    options = WorkerOptions(queues=("q",), concurrency=3)
    assert skiplock.Worker(app, options).options == options
    assert skiplock.Worker(app, queues=["q"], concurrency=3).options == options
    assert skiplock.Worker(app, options, concurrency=5).options.concurrency == 5
    with pytest.raises(TypeError, match="unknown options concurency"):
        skiplock.Worker(app, concurency=4)


def test_options_a_command_line_does_not_have_keep_their_defaults() -> None:
    """A command that defines only some of the flags (or none) gets the defaults of the
    rest, never None in their place."""
    assert WorkerOptions.from_arguments({}, {}) == WorkerOptions()
    assert WorkerOptions.from_arguments({"concurrency": 4}, {}) == WorkerOptions(concurrency=4)
