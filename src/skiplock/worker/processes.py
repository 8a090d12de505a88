"""``--processes N``: N single-process workers under one supervisor, for CPU-bound sync
handlers. ``skiplock worker`` and ``manage.py skiplock_worker`` both run this loop
(``run_fleet``), each giving the command line that starts one of its worker processes.

The supervisor restarts a worker process that dies and forwards a stop signal to every
one. A signal handler only records the signal; the loop does everything else, so the
decision to restart and the forwarding cannot interleave: a replacement started just
before a stop was asked is told at the next turn of the loop (within ``TURN`` seconds),
and no dead worker is replaced once a stop was asked.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skiplock.errors import ConfigurationError
from skiplock.worker import options

log = logging.getLogger("skiplock.worker")

# How long a dead worker process waits to be replaced: a child that dies at start-up
# (a bad option, the database down) is not restarted in a tight loop.
RESTART_DELAY = 1.0
TURN = 0.1  # seconds between two looks at the children and the signals received

# Signals that stop the workers, and the one each is forwarded as. A closed terminal
# (SIGHUP) stops them as SIGTERM does: they run in sessions of their own and would not
# hear it.
_FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT}
_FORWARDED[signal.SIGHUP] = signal.SIGTERM


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    signals_sent: int = 0  # how many of the stop signals received it was sent
    restart_at: float | None = None  # once it died: when to start its replacement


def run_fleet(program: Sequence[str], given: Mapping[str, Any], env: dict[str, str]) -> int:
    """Run ``given["processes"]`` worker processes, each ``program`` followed by the worker
    options of ``given`` (a parsed command line) as they were given. A URL, which may hold
    a password, reaches them through ``env``, their environment, never their command
    line (which every user of the machine can read)."""
    if given.get("metrics_port"):
        raise ConfigurationError(
            "--metrics-port serves one process; with --processes run the workers "
            "separately, each with its own port"
        )
    command = [*program, *options.child_arguments(given, env)]
    return run_processes(command, given["processes"], env=env)


def run_processes(
    command: Sequence[str], count: int, *, env: Mapping[str, str] | None = None
) -> int:
    """Run ``count`` copies of ``command`` until a stop signal (SIGTERM, SIGINT, SIGHUP),
    restarting any that dies; forward each stop signal to every copy, and return 0 once
    all have exited.

    Each copy runs in a session of its own: a Ctrl-C at the terminal then reaches it
    once, forwarded from here (a second SIGINT tells a worker to give up on its running
    jobs)."""
    received: list[int] = []

    def record(signum: int, _frame: object) -> None:
        received.append(_FORWARDED[signal.Signals(signum)])

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(command), env=None if env is None else dict(env), start_new_session=True
        )

    previous = {signum: signal.signal(signum, record) for signum in _FORWARDED}
    try:
        children = [_Child(start()) for _ in range(count)]
        while True:
            _turn(children, received, start)
            if received and all(child.process.poll() is not None for child in children):
                return 0
            time.sleep(TURN)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _turn(
    children: list[_Child], received: list[int], start: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """One look at the children: forward the stop signals each has not been sent yet,
    and replace (after ``RESTART_DELAY``) those that died, unless a stop was asked."""
    now = time.monotonic()
    for child in children:
        process = child.process
        code = process.poll()
        if code is None:
            unsent = received[child.signals_sent :]  # a signal arriving meanwhile waits a turn
            for signum in unsent:
                process.send_signal(signum)
            child.signals_sent += len(unsent)
            continue
        if received:
            continue
        if child.restart_at is None:
            log.warning(
                "worker process %s exited with %s; restarting it in %gs",
                process.pid,
                code,
                RESTART_DELAY,
            )
            child.restart_at = now + RESTART_DELAY
        elif now >= child.restart_at:
            child.process = start()
            child.signals_sent = 0
            child.restart_at = None
