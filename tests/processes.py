"""Worker processes for tests: ``python -m skiplock ... worker APP`` as a real subprocess.

``spawn_worker_process`` starts one, its output in a log file of the test's, and returns a
``WorkerProcess``: its pid, its log, the signals a test sends it (SIGKILL, SIGSTOP and the
rest), ``check_alive`` for ``wait_until(check=...)`` and ``exit_code``. A hung worker can
be made to print every thread's stack to its log (``PYTHONFAULTHANDLER`` is set, and
``exit_code`` sends SIGABRT when it does not exit in time). ``registered_worker_id``
reads the id the worker registered under.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from conftest import wait_until

# The repository: workers run from here, so that ``tests.<module>:app`` imports.
ROOT = Path(__file__).resolve().parents[1]

# How long a signalled process gets to show it took the signal.
SIGNAL_TIMEOUT = 20.0


@dataclass
class WorkerProcess:
    """A ``skiplock worker`` subprocess, its log, the name its sessions carry (when the
    test gave one) and its id once it registered."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    appname: str = ""
    id: uuid.UUID | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, and reap it: its sockets are closed once this returns."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=SIGNAL_TIMEOUT)

    def stop(self) -> None:
        """SIGSTOP, returning once the kernel shows the process stopped."""
        self.proc.send_signal(signal.SIGSTOP)
        wait_until(self.is_stopped, SIGNAL_TIMEOUT, what=f"worker {self.pid} to stop")

    def is_stopped(self) -> bool:
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def check_alive(self) -> None:
        """Fail, with the end of its log, if it has exited."""
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"worker {self.pid} exited with {code}:\n{self.log()[-4000:]}")

    def exit_code(self, timeout: float) -> int:
        """Its exit status; if it has not exited within ``timeout`` seconds, it is made to
        print every thread's stack to its log (SIGABRT) and the test fails with that."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(timeout=SIGNAL_TIMEOUT)
            raise AssertionError(
                f"worker {self.pid} did not exit within {timeout}s:\n{self.log()[-6000:]}"
            ) from None


def spawn_worker_process(
    url: str,
    app: str,
    *worker_args: str,
    log_path: Path,
    schema: str | None = None,
    options: Sequence[str] = (),
    appname: str = "",
    env: Mapping[str, str | None] | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> WorkerProcess:
    """Start ``python -m skiplock --database-url URL [--schema S] OPTIONS... worker APP
    ARGS...`` from the repository, not waiting for it. ``env`` is laid over this
    process's environment (a None value removes a variable); ``appname``, when given, is
    its ``PGAPPNAME``; ``wrap`` turns the command into the one to run (``ip netns exec
    HOST ...``, say)."""
    command = [sys.executable, "-m", "skiplock", "--database-url", url]
    if schema is not None:
        command += ["--schema", schema]
    command += [*options, "worker", app, *worker_args]
    if wrap is not None:
        command = wrap(command)
    environment = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    if appname:
        environment["PGAPPNAME"] = appname
    for name, value in (env or {}).items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT
        )
    return WorkerProcess(proc, log_path, appname)


def registered_worker_id(
    conn: psycopg.Connection[Any], pid: int, schema: str = "skiplock"
) -> uuid.UUID | None:
    """The id the worker process ``pid`` registered under, None until it has."""
    row = conn.execute(
        sql.SQL("SELECT id FROM {} WHERE pid = %s").format(sql.Identifier(schema, "workers")),
        (pid,),
    ).fetchone()
    return None if row is None else uuid.UUID(str(row[0]))


def kill_all(workers: Iterable[WorkerProcess]) -> None:
    """SIGKILL every one still running (stopped ones too: no SIGCONT needed), and reap it."""
    for worker in workers:
        if worker.alive:
            worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(timeout=SIGNAL_TIMEOUT)
