"""How a worker runs: the one place each worker option is defined, defaulted, checked and
documented.

``Worker(app, WorkerOptions(...))`` (or ``Worker(app, concurrency=4)``, the same fields as
keywords) takes them from Python; ``skiplock worker`` and ``manage.py skiplock_worker``
take them from their command lines through ``add_arguments`` and ``from_arguments``, so
the three cannot disagree on a name, a default or what a value may be.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from skiplock.command_line import (
    CONCURRENCY,
    RETENTION_DAYS,
    TCP_USER_TIMEOUT,
    prefetch_setting,
    seconds,
)
from skiplock.errors import ConfigurationError
from skiplock.pooler import (
    LISTEN_URL_ENV,
    POLL_ONLY_INTERVAL,
    check_worker_connections,
    resolve_poll_interval,
)
from skiplock.tasks import MAX_QUEUE_NAME, check_name
from skiplock.worker.keepalives import DEFAULT_TCP_USER_TIMEOUT


@dataclass(frozen=True)
class Flag:
    """How one option is given on a command line.

    ``parse`` reads the text; ``convert`` turns what was read into the option's value
    (days into a timedelta, 0 into None). A flag with a ``switch`` takes no value: given,
    the option is ``switch``; left out, the opposite. A ``secret`` (a URL that may hold a
    password) falls back to ``env`` and reaches a child process through its environment,
    never its command line, which every user of the machine can read.
    """

    name: str
    help: str
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    default: Any = None
    switch: bool | None = None
    convert: Callable[[Any], Any] | None = None
    show: Callable[[Any], str | None] | None = None
    env: str | None = None

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def value(self, given: Any, environ: Mapping[str, str]) -> Any:
        if self.switch is not None:
            return self.switch if given else not self.switch
        if self.env is not None and not given:
            given = environ.get(self.env) or None
        return self.convert(given) if self.convert is not None else given

    def child_argv(self, given: Any, environ: dict[str, str]) -> list[str]:
        if self.switch is not None:
            return [self.name] if given else []
        if self.env is not None:
            if given:
                environ[self.env] = str(given)
            return []
        text = self.show(given) if self.show is not None else _exactly(given)
        return [] if text is None else [self.name, text]


def _exactly(value: Any) -> str | None:
    """``value`` as the shortest text that reads back as the same number ("30", "0.1"),
    or None for an option left unset. Pure."""
    if value is None:
        return None
    return repr(value).removesuffix(".0") if isinstance(value, float) else str(value)


def _retention(days: float) -> timedelta | None:
    return None if days <= 0 else timedelta(days=days)


def _flag(flag: Flag) -> dict[str, Flag]:
    return {"flag": flag}


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """A worker's settings, checked when built (a bad value raises ConfigurationError
    naming it). Seconds are floats; the worker's effective poll interval, listening and
    liveness lock follow from several fields together (``poll_seconds``, ``listens``,
    ``holds_liveness_lock``)."""

    queues: tuple[str, ...] = ("default",)
    """The queues to claim from (the CLI's default: every queue a registered task names)."""
    concurrency: int = field(
        default=10,
        metadata=_flag(
            Flag(
                "--concurrency",
                "jobs run at once per process (default: %(default)s)",
                CONCURRENCY,
                "N",
                10,
            )
        ),
    )
    prefetch: int | None = field(
        default=None,
        metadata=_flag(
            Flag(
                "--prefetch",
                "jobs to claim beyond free slots, so a start skips a claim round trip (they "
                "wait leased; given back at shutdown). auto sizes it from how long jobs and "
                "claims take: short jobs are claimed in batches, long ones not ahead "
                "(default: auto)",
                prefetch_setting,
                "auto|N",
                show=lambda value: "auto" if value is None else str(value),
            )
        ),
    )
    """Jobs claimed beyond free capacity, waiting leased for a slot (decision 018): None
    sizes it from how long jobs and claims take, a number caps it, 0 turns it off."""
    lease_seconds: float = field(
        default=30.0,
        metadata=_flag(
            Flag(
                "--lease",
                "how long a claimed job is held without a heartbeat before another worker may "
                "rescue it; heartbeats extend it while the job runs (default: %(default)g)",
                seconds(above_zero=True),
                "SECONDS",
                30.0,
            )
        ),
    )
    poll_interval: float | None = field(
        default=None,
        metadata=_flag(
            Flag(
                "--poll-interval",
                "how often to look for jobs when no notification arrives; notifications wake "
                "the worker at once (default: 1, or 0.2 without a listener)",
                seconds(above_zero=True),
                "SECONDS",
            )
        ),
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata=_flag(
            Flag(
                "--shutdown-timeout",
                "at shutdown, how long running jobs may take to finish before they are "
                "released back to their queue (default: %(default)g)",
                seconds(),
                "SECONDS",
                30.0,
            )
        ),
    )
    history_retention: timedelta | None = field(
        default=timedelta(days=7),
        metadata=_flag(
            Flag(
                "--history-retention-days",
                "drop finished jobs older than this; 0 keeps them forever (default: %(default)g)",
                RETENTION_DAYS,
                "DAYS",
                7.0,
                convert=_retention,
            )
        ),
    )
    liveness_lock: bool = field(
        default=True,
        metadata=_flag(
            Flag(
                "--no-liveness-lock",
                "behind a transaction-mode pooler (PgBouncer): rescue by lease expiry only "
                "(default: hold a liveness lock, so a dead worker's jobs are rescued at once)",
                switch=False,
            )
        ),
    )
    tcp_user_timeout: float | None = field(
        default=DEFAULT_TCP_USER_TIMEOUT,
        metadata=_flag(
            Flag(
                "--tcp-user-timeout",
                "drop a connection whose peer stopped answering (a cut link) after about "
                "this long, by TCP keepalives and tcp_user_timeout, unless the URL sets them "
                "(0: the system's defaults; default 30)",
                TCP_USER_TIMEOUT,
                "SECONDS",
                DEFAULT_TCP_USER_TIMEOUT,
                convert=lambda value: value or None,
            )
        ),
    )
    """Seconds a connection whose peer stopped answering looks alive (keepalives.py);
    None leaves the operating system's defaults."""
    pooler: bool = field(
        default=False,
        metadata=_flag(
            Flag(
                "--pooler",
                "the database URL is a pooler in transaction mode (PgBouncer): no prepared "
                "statements or session locks on its connections; LISTEN and the liveness lock "
                "need --listen-url (else the worker polls and rescue waits for leases) "
                "(default: a direct connection)",
                switch=True,
            )
        ),
    )
    listen_url: str | None = field(
        default=None,
        metadata=_flag(
            Flag(
                "--listen-url",
                f"PostgreSQL URL for the listener and the heartbeat (default: ${LISTEN_URL_ENV}, "
                "else the database URL): direct or session-mode, where LISTEN and session "
                "locks work",
                env=LISTEN_URL_ENV,
            )
        ),
    )
    """Behind a pooler (pooler.py): a direct or session-mode URL for the listener and the
    heartbeat, which then hold the liveness lock."""
    listen: bool = field(
        default=True,
        metadata=_flag(
            Flag(
                "--no-listen",
                f"no LISTEN connection: poll for jobs (every {POLL_ONLY_INTERVAL:g}s unless "
                "--poll-interval says otherwise) (default: listen, so new jobs wake the worker)",
                switch=False,
            )
        ),
    )
    # Tuning without a flag: tests and benchmarks set them.
    batch_max: int = 100
    transactional_batch: int = 10
    rescue_interval: float = 1.0
    sweep_interval: float = 5.0
    leader_ttl: float = 10.0
    history_interval: float = 60.0
    completer_interval: float = 0.002
    admit_interval: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.queues, str):
            raise ConfigurationError(
                f"queues must be a list of queue names, got the string {self.queues!r}"
            )
        queues = tuple(dict.fromkeys(self.queues))
        if not queues:
            raise ConfigurationError("a worker needs at least one queue")
        for queue in queues:
            check_name("queue", queue, MAX_QUEUE_NAME)
        object.__setattr__(self, "queues", queues)
        _check_count("concurrency", self.concurrency, minimum=1)
        if self.prefetch is not None:
            _check_count(
                "prefetch", self.prefetch, minimum=0, none="None (sized from job durations)"
            )
        _check_positive("lease_seconds", self.lease_seconds)
        if self.poll_interval is not None:
            _check_positive("poll_interval", self.poll_interval)
        if self.tcp_user_timeout is not None:
            _check_positive(
                "tcp_user_timeout",
                self.tcp_user_timeout,
                none="None for the operating system's defaults",
            )
        check_worker_connections(pooler=self.pooler, listen=self.listen, listen_url=self.listen_url)

    @property
    def listens(self) -> bool:
        """Whether the worker holds a LISTEN connection: not behind a pooler without a
        listen URL, where there is nowhere to LISTEN."""
        return check_worker_connections(
            pooler=self.pooler, listen=self.listen, listen_url=self.listen_url
        )

    @property
    def poll_seconds(self) -> float:
        return resolve_poll_interval(self.poll_interval, self.listens)

    @property
    def holds_liveness_lock(self) -> bool:
        """Behind a pooler only the listener (on the listen URL) and the heartbeat can
        hold the liveness lock; without a listener the worker is rescued by lease expiry."""
        return self.liveness_lock and (not self.pooler or self.listens)

    @classmethod
    def from_arguments(
        cls, given: Mapping[str, Any], environ: Mapping[str, str], **others: Any
    ) -> WorkerOptions:
        """The options of a parsed command line (``vars(namespace)``, or Django's options
        dict) that ``add_arguments`` defined; ``others`` (the queues) as they are. An
        option whose flag ``given`` lacks keeps its default."""
        values = {
            name: flag.value(given[flag.dest], environ)
            for name, flag in _flags().items()
            if flag.dest in given
        }
        return cls(**values, **others)


def _flags() -> dict[str, Flag]:
    return {f.name: f.metadata["flag"] for f in fields(WorkerOptions) if "flag" in f.metadata}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every worker option that has a flag to ``parser``."""
    for flag in _flags().values():
        if flag.switch is not None:
            parser.add_argument(flag.name, action="store_true", help=flag.help)
        else:
            parser.add_argument(
                flag.name,
                type=flag.parse or str,
                default=flag.default,
                metavar=flag.metavar,
                help=flag.help,
            )


def child_arguments(given: Mapping[str, Any], environ: dict[str, str]) -> list[str]:
    """The flags that give a child process (``--processes``) the options of this command
    line as they were given; secrets go into ``environ``, the child's environment."""
    argv: list[str] = []
    for flag in _flags().values():
        argv += flag.child_argv(given.get(flag.dest), environ)
    return argv


def _check_count(name: str, value: Any, *, minimum: int, none: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        also = f"{none} or " if none else ""
        raise ConfigurationError(f"{name} must be {also}an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: Any, *, none: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        also = f", or {none}" if none else ""
        raise ConfigurationError(f"{name} must be positive seconds{also}, got {value!r}")
